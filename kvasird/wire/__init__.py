"""Bytes on the wire: msgpack frames with hard limits, shared by every stream protocol.

    framing    length-prefixed msgpack frames over any byte stream (libp2p or trio)
    schema     small strict checks of decoded peer input, each failure a WireError naming
               the field
    protocols  every peer protocol id and gossip topic, and the message types of each
    rpc        request/response with ids and one-way messages over one long-lived stream:
               Channel (caller), serve (server), Intake, the errors of a peer call

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. The
length is checked against the protocol's limit *before* reading the body, so an
oversized or malicious length costs nothing (a server may also read the length alone,
``FrameReader.length``, and decide by who sends it). Decoded values are plain msgpack types;
each protocol validates them into its own frozen records before use.
"""

from kvasird.wire.framing import (
    ByteStream,
    FrameReader,
    FrameTooLarge,
    frame,
    pack,
    read_frame,
    unpack,
    write_frame,
)

__all__ = [
    "ByteStream",
    "FrameReader",
    "FrameTooLarge",
    "frame",
    "pack",
    "read_frame",
    "unpack",
    "write_frame",
]
