"""The node's identity: an Ed25519 libp2p key kept in the state directory (mode 0600).

The peer id derived from it is the node id everywhere: in gossip records, receipts, logs.

    nodekey   creating and loading the node key
"""

from kvasird.identity.nodekey import NodeKey, create_node_key, load_node_key

__all__ = ["NodeKey", "create_node_key", "load_node_key"]
