"""The peer protocols of inference: their ids, their messages, the arrays they carry.

    stage      "/kvasir/stage/1": Open, Step (+ Forward), Close, Ping, Result, Failure and
               the replies Hidden, TokenEvent, Pong, Closed; sampling's one wire form
    experts    "/kvasir/experts/1": ExpertRequest, and its reply Outputs
    tensors    arrays on the wire: raw f32/f16/i32 bytes in msgpack bin fields, validated
    delegation a gateway's signed word that a stage computes rows of its sessions

Every message is a frozen type with ``from_wire`` (strict: types, bounds, real booleans;
WireError naming the field) and ``to_wire``. channel.serve hands each frame to its
protocol's ``parse`` as it is read, so a handler only ever sees a validated message.

Messages (msgpack maps, each with the caller's integer "id", echoed in the reply; arrays
as tensors maps; a refusal is {"error": reason, "code": one of errors.CODES: "busy" |
"gone" | "bad" | "unpaid" | "unreachable"}), each with the type stage.py or experts.py
defines for it and for its reply:

    Open    {op: open, sid, model, first, end, embed, head, max_tokens, logprobs, prev,
             sampling: {temperature, top_k, top_p, repetition_penalty, seed}, draws,
             delegation (the gateway's, to this hop)}  -> {}
    Step    {op: step, sid, start, x: i32 [T] | f32/f16 [T, n_embd], ids (head hop: the T
             tokens), singly? (true: compute the T positions one at a time, an exact
             replay of decode steps), verify? (true: ids[1:] are guesses to check),
             part? ([j, n]: row j of a forwarded check sent on alone)}
             -> Hidden {x: [T, n_embd]}  or, at the head,
             TokenEvent {token, logprob?, top?: [[token, logprob], ...]}
    Close   {op: close, sid}    -> Closed {experts?: {worker peer: units}, steps?: per step
             the digests of its input and output (tensors.digest), 32 bytes a step}
    Ping    {op: ping, sid}                                  -> Pong {at: positions computed}
    Reveal  {op: reveal, sid, first, last}  -> Revealed {steps: [{start, x, out, singly?}]}:
             the session's steps as computed (owner only; kept a while after the close)
    ExpertRequest {op: experts, layer, first, rows: [m, n_embd], ids: i32 [m, n] counted
             from first, for: [[delegation, rows], ...]}       -> Outputs {out: [m, n, n_embd]}

Accounting: the gateway measures each stage's work itself (positions x layers); what it
cannot see is the expert rows a stage sent on, so closing a session answers with the
units (the experts its rows selected) each expert worker computed for it, and every
expert request proves whose sessions its rows belong to (``for``: each gateway's signed
delegation to the caller, with its rows). Paid networks: a session opens, and a worker
computes, only for gateways ``admit`` accepts ("unpaid" refusal otherwise).

Forwarding (one-way messages, id 0): a Step with a Forward part, ``back: {ticket}`` and
``next: [[peer, sid], ...]`` (the rest of the route), is answered by no one. The stage
computes and sends its output to the next hop as the same kind of step (``owner``: the
gateway whose session it is; ``next`` one shorter); the last hop sends a Result ``{op:
result, ticket, token, logprob?, top?}`` to the owner. Any failure on the way ends the
chain with a Failure ``{op: result, ticket, error, code, peer}`` to the owner, naming the
peer that failed: itself, or the next hop it could not reach (code "gone", or
"unreachable" when no stream to it could be opened; "broken" when its own output was not
finite). A session takes forwarded steps only
from its owner and from the peer the owner named as the hop before it (``prev`` at open).
A traced step also carries ``trace``: each hop's stamps so far (steptrace). A speculative
step computed singly (``verify: true, singly: true``) goes on from a hop a row at a time,
as each row is computed: each row a step of its own with ``part: [j, n]`` (row j of n, at
position start + j, the n ids with it), the same ticket; the next hop takes them in order
and the head answers once, at its first draw that is not the next guess.
"""

from kvasird.wire.protocols import EXPERT_PROTOCOL, STAGE_PROTOCOL

__all__ = ["EXPERT_PROTOCOL", "MAX_EXPERTS", "MAX_LAYERS", "STAGE_PROTOCOL"]

MAX_LAYERS = 4096
"""Most layers a model on the wire may have (a node checks against its own model's)."""
MAX_EXPERTS = 65536
"""Most experts a layer on the wire may have."""
