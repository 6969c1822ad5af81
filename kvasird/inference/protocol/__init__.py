"""The peer protocols of inference: their ids, their messages, the arrays they carry.

    tensors    arrays on the wire: raw f32/f16/i32 bytes in msgpack bin fields, validated

Messages (msgpack maps, each with the caller's integer "id", echoed in the reply; arrays
as tensors maps; a refusal is {"error": reason, "code": "busy" | "gone"
| "bad"}):

    open   {op, sid, model, first, end, embed, head, max_tokens, logprobs, prev,
            sampling: {temperature, top_k, top_p, repetition_penalty, seed}, draws}  -> {}
    step   {op, sid, start, x: i32 [T] | f32/f16 [T, n_embd], ids (head hop: the T tokens)}
             -> {x: [T, n_embd]}  or, at the head,  {token, logprob?, top?}
    close  {op, sid}                                  -> {experts?: {worker peer: units}}
    ping   {op, sid}                                       -> {at: positions computed}
    experts {op, layer, first, rows: [m, n_embd], ids: i32 [m, n] counted from first,
             for: [gateway peer, ...]}                                 -> {out: [m, n, n_embd]}

Accounting: the gateway measures each stage's work itself (positions x layers); what it
cannot see is the expert rows a stage sent on, so closing a session answers with the
units (the experts its rows selected) each expert worker computed for it, and every
expert request names the gateways whose sessions its rows belong to (``for``). Paid
networks: a session opens, and a worker computes, only for gateways ``admit`` accepts
("unpaid" refusal otherwise).

Forwarding (one-way messages, id 0): a step with ``back: {ticket}`` and ``next: [[peer,
sid], ...]`` (the rest of the route) is answered by no one. The stage computes and sends
its output to the next hop as the same kind of step (``owner``: the gateway whose session
it is; ``next`` one shorter); the last hop sends ``{op: result, ticket, token, logprob?,
top?}`` to the owner. Any failure on the way ends the chain with ``{op: result, ticket,
error, code, peer}`` to the owner, naming the peer that failed: itself, or the next hop
it could not reach (code "gone", or "unreachable" when no stream to it could be opened).
A session takes forwarded steps only from its owner and from the peer the owner named as
the hop before it (``prev`` at open).
"""

STAGE_PROTOCOL = "/kvasir/stage/1"
EXPERT_PROTOCOL = "/kvasir/experts/1"
