"""KDA state passing: the building block of exact context parallelism (CP) for KDA.

Per head the recurrence (reference.py) is, with S of shape [K, V],

    S_t = A_t S_{t-1} + b_t k_t v_t^T,     A_t = (I - b_t k_t k_t^T) Diag(exp(gate_t))  [K, K]

so across a segment of tokens t = 1..L that stays inside one document the state map is
affine, acting on the key (row) index of S from the left:

    S_out = M S_in + S_ext,   M = A_L ... A_2 A_1  [K, K],   S_ext = S_out from S_in = 0  [K, V]

A document that starts inside the segment resets the state there: nothing before the reset
reaches S_out, so M = 0 and S_ext is the state at the segment end of that last document,
started from its own initial state (zero by default).

CP forward (one rank per segment): every rank computes (M_c, S_ext_c) for its segment,
the ranks all-gather them, each rank chains the ones before it (``chain_states``,
S_in_{c+1} = M_c S_in_c + S_ext_c, fp32) and reruns its segment from S_in_c.
``kda_cp_simulate`` does all of it in one process for tests.  Everything is plain torch
ops or the differentiable ``kda`` entry, so autograd yields the backward (the mirror
chain dS_in_c = M_c^T dS_in_{c+1}, dM_c = dS_in_{c+1} S_in_c^T); see docs/kda_notes.md.

Shapes: q, k, g [B, L, H, K]; v [B, L, H, V]; beta [B, L, H]; M [B, H, K, K];
S_ext, S_in [B, H, K, V] (B = 1 for packed documents).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from . import MAX_V, kda, validate_inputs
from .reference import REF_CHUNK, _chunked_all, _prepare, _seq_bounds

__all__ = ["chain_dtype", "transition_recurrent", "segment_transition", "chain_states",
           "segment_bounds", "kda_cp_simulate"]


def chain_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of M, S_ext and the chain: fp32, or fp64 for fp64 inputs (never lower)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, scale, use_qk_l2norm,
         initial_state, cu_seqlens=None, op=kda):
    """One KDA pass from ``initial_state`` [N, H, K, V]; returns (o in v's dtype, final
    [N, H, K, V] in chain_dtype).  fp64 inputs stay fp64 (the public entries return an
    fp32 final state, too coarse for fp64 tests); everything else goes through ``op``."""
    if q.dtype == torch.float64:
        qf, kf, vf, gate, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                                        use_qk_l2norm, torch.float64)
        seqs = _seq_bounds(q.shape[0], q.shape[1], cu_seqlens)
        o, S = _chunked_all(qf, kf, vf, gate, bf, initial_state.double(), REF_CHUNK, seqs)
        return o.to(v.dtype), S
    o, S = op(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, scale=scale,
              initial_state=initial_state.float().contiguous(), output_final_state=True,
              cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return o, S


def transition_recurrent(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None,
                         use_qk_l2norm=True, dtype=torch.float32):
    """Token-by-token (M [B,H,K,K], S_ext [B,H,K,V]) of a segment without a document start,
    per batch row; the ground truth for the chunked path.  Same prepared inputs as
    ``kda_recurrent`` (gate after A_log/dt_bias/lower_bound, l2-normed k, sigmoid beta).
    Differentiable."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    _, kf, vf, gate, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                                   use_qk_l2norm, dtype)
    M = torch.eye(K, dtype=dtype, device=q.device).expand(B, H, K, K)
    S = kf.new_zeros(B, H, K, V)
    for t in range(L):
        d = torch.exp(gate[:, t])[..., None]                          # Diag(exp gate_t)
        kt, bt = kf[:, t], bf[:, t][..., None]                         # [B,H,K], [B,H,1]
        M = d * M                                                      # D_t M
        M = M - torch.einsum("bhk,bhj->bhkj", bt * kt, torch.einsum("bhk,bhkj->bhj", kt, M))
        S = d * S
        S = S + torch.einsum("bhk,bhv->bhkv", bt * kt,
                             vf[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
    return M, S


def segment_transition(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None,
                       use_qk_l2norm=True, cu_seqlens=None, starts_document=False,
                       reset_state=None, recurrent=False, op=kda):
    """(M [B,H,K,K], S_ext [B,H,K,V]) of one segment, in chain_dtype(q.dtype).

    Maps the state entering the segment (the state after the token before it) to the state
    after its last token.  cu_seqlens (int tensor, B == 1): the segment's local document
    boundaries [0, ..., L]; starts_document: the segment's first token starts a new document
    (not the first document of the sequence, whose initial state is the chain's S0).  If a
    document starts anywhere in the segment, M = 0 and S_ext is the last document's state
    at the segment end, run from reset_state ([B,H,K,V], that document's initial state;
    zero if None).  Otherwise M comes from one kda pass on values [0 | v] from the initial
    state [I | 0] (the recurrence is linear in the state, so it carries M in the first K
    value columns and S_ext in the rest) when K + V <= MAX_V, else from a second pass.
    recurrent=True uses the token-by-token references instead (tests)."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    cd = chain_dtype(q.dtype)
    kw = dict(lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm)
    last = int(cu_seqlens[-2]) if cu_seqlens is not None else 0
    if starts_document or last > 0:
        # Reset inside the segment: no state crosses the document start, so M = 0 exactly;
        # only the last document's tokens [last, L) reach S_out.
        M = q.new_zeros(B, H, K, K, dtype=cd)
        tail = [x[:, last:].contiguous() for x in (q, k, v, g, beta)]
        S0 = q.new_zeros(B, H, K, V, dtype=cd) if reset_state is None else reset_state.to(cd)
        if recurrent:
            Mt, St = transition_recurrent(*tail, A_log, dt_bias, dtype=cd, **kw)
            return M, Mt @ S0 + St
        return M, _run(*tail, A_log, dt_bias, initial_state=S0, op=op, **kw)[1]
    if recurrent:
        return transition_recurrent(q, k, v, g, beta, A_log, dt_bias, dtype=cd, **kw)
    eye = torch.eye(K, dtype=cd, device=q.device).expand(B, H, K, K)
    zeros_s = q.new_zeros(B, H, K, V, dtype=cd)
    if K + V <= MAX_V:
        v_aug = torch.cat([v.new_zeros(B, L, H, K), v], -1)
        X = _run(q, k, v_aug, g, beta, A_log, dt_bias, op=op,
                 initial_state=torch.cat([eye, zeros_s], -1), **kw)[1]
        return X[..., :K], X[..., K:]
    M = _run(q, k, v.new_zeros(B, L, H, K), g, beta, A_log, dt_bias, op=op,
             initial_state=eye.contiguous(), **kw)[1]
    S_ext = _run(q, k, v, g, beta, A_log, dt_bias, op=op, initial_state=zeros_s, **kw)[1]
    return M, S_ext


def chain_states(M: torch.Tensor, S_ext: torch.Tensor, S0: torch.Tensor | None = None):
    """Prefix combine of C consecutive segments: S_in [C, *, K, V].

    M [C, *, K, K], S_ext [C, *, K, V], S0 [*, K, V] (state entering segment 0, zero if
    None).  S_in[0] = S0, S_in[c+1] = M[c] S_in[c] + S_ext[c].  Runs in fp32 (fp64 if any
    input is fp64), whatever the dtype of the tokens.  C is the CP size (<= 16), so the
    sequential form is as cheap as a log-depth scan; on rank r only S_in[r] is needed."""
    dt = torch.promote_types(torch.promote_types(M.dtype, S_ext.dtype), torch.float32)
    if S0 is not None:
        dt = torch.promote_types(dt, S0.dtype)
    S = S_ext.new_zeros(S_ext.shape[1:], dtype=dt) if S0 is None else S0.to(dt)
    out = []
    for c in range(M.shape[0]):
        out.append(S)
        S = M[c].to(dt) @ S + S_ext[c].to(dt)
    return torch.stack(out, 0)


def segment_bounds(T: int, segments: int | Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] of contiguous segments: C = int (sizes differ by at most one, longer
    first) or a list of positive lengths summing to T."""
    if isinstance(segments, int):
        if not 1 <= segments <= T:
            raise ValueError(f"kda cp: {segments} segments for T = {T} tokens")
        lens = [T // segments + (1 if c < T % segments else 0) for c in range(segments)]
    else:
        lens = [int(x) for x in segments]
        if not lens or min(lens) < 1 or sum(lens) != T:
            raise ValueError(f"kda cp: segment lengths {lens} must be positive and sum to T = {T}")
    ends = torch.tensor(lens).cumsum(0).tolist()
    return [(e - n, e) for n, e in zip(lens, ends)]


def kda_cp_simulate(q, k, v, g, beta, A_log, dt_bias, *, segments, lower_bound=-5.0,
                    scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    use_qk_l2norm=True, recurrent=False, op=kda):
    """CP forward of ``kda`` on one process: split [B, T] into segments (see
    ``segment_bounds``), (M_c, S_ext_c) per segment, ``chain_states``, rerun each segment
    from its S_in_c, concatenate.  Same inputs and outputs as ``kda`` (o [B,T,H,V] in v's
    dtype, final [N,H,K,V] or None), except that final is in chain_dtype(q.dtype).
    Packed documents (cu_seqlens, B == 1) may cross segments and start inside them."""
    N, cu = validate_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                            initial_state, cu_seqlens)
    _, T, H, K = q.shape
    V = v.shape[-1]
    cd = chain_dtype(q.dtype)
    kw = dict(lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm)
    init = initial_state.to(cd) if initial_state is not None else None
    zero = q.new_zeros(H, K, V, dtype=cd)
    bounds = segment_bounds(T, segments)
    starts = set(cu or [])

    def local(a, b):
        """Local cu_seqlens of segment [a, b), the documents it touches, starts_document."""
        if cu is None:
            return None, None, False
        inner = [x - a for x in cu if a < x < b]
        first = bisect.bisect_right(cu, a) - 1
        docs = list(range(first, first + len(inner) + 1))
        return [0] + inner + [b - a], docs, a in starts and a > 0

    # 1. Each rank: its segment's transition (M_c, S_ext_c).
    Ms, Ss, layout = [], [], []
    for a, b in bounds:
        seg = [x[:, a:b].contiguous() for x in (q, k, v, g, beta)]
        lcu, docs, starts_doc = local(a, b)
        layout.append((seg, lcu, docs, starts_doc))
        reset_state = init[docs[-1]][None] if (init is not None and docs) else None
        M, S = segment_transition(
            *seg, A_log, dt_bias,
            cu_seqlens=None if lcu is None else torch.tensor(lcu, device=q.device),
            starts_document=starts_doc, reset_state=reset_state, recurrent=recurrent, op=op,
            **kw)
        Ms.append(M)
        Ss.append(S)
    # 2. All-gather (here: stack) and prefix combine, fp32.  S0 enters the first document.
    S0 = None if init is None else (init if cu is None else init[:1])
    S_in = chain_states(torch.stack(Ms), torch.stack(Ss), S0)            # [C, B, H, K, V]
    # 3. Each rank: rerun its segment from S_in_c.
    outs, finals = [], [None] * N
    for c, ((a, b), (seg, lcu, docs, starts_doc)) in enumerate(zip(bounds, layout)):
        if cu is None:
            o, fin = _run(*seg, A_log, dt_bias, initial_state=S_in[c], op=op, **kw)
            if c == len(bounds) - 1:
                finals = list(fin)
        else:
            h0 = [S_in[c][0] if j == 0 and not starts_doc
                  else (init[n] if init is not None else zero) for j, n in enumerate(docs)]
            o, fin = _run(*seg, A_log, dt_bias, initial_state=torch.stack(h0), op=op,
                          cu_seqlens=torch.tensor(lcu, device=q.device), **kw)
            for j, n in enumerate(docs):
                if a + lcu[j + 1] == cu[n + 1]:                            # document ends here
                    finals[n] = fin[j]
        outs.append(o)
    o = torch.cat(outs, 1)
    return o, (torch.stack(finals, 0) if output_final_state else None)
