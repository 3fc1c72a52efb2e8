"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the recurrence and its short conv.

Per value head, with state ``S`` ``[dk, dv]``, decay ``a_t = exp(g_t)`` (``g_t <= 0``),
write strength ``b_t`` in ``(0, 1)`` and unit-norm keys::

    S_t = a_t (I - b_t k_t k_tᵀ) S_{t-1} + b_t k_t v_tᵀ        o_t = S_tᵀ q_t

Before the recurrence the layer's mixed ``q|k|v`` input passes a depthwise causal conv of
``K`` taps (then SiLU); its state is the last ``K - 1`` inputs. A *checkpoint* at token count
``n`` is both: ``RecurrentState(conv = inputs [n - K + 1, n), ssm = S_n)`` — enough to resume
the layer at token ``n`` exactly.

Two paths compute the same function:

- ``gated_delta_reference``: the recurrence above token by token (meant for float64 on the
  CPU: the exactness check of ``hybridkv verify``);
- ``gated_delta_chunked``: the chunked (WY / UT-transform) form over chunks of ``C`` tokens.
  With ``u_t = b_t (v_t - a_t S_{t-1}ᵀ k_t)`` the state update is ``S_t = a_t S_{t-1} +
  k_t u_tᵀ``; within a chunk starting at state ``S_0`` (cumulative decay ``γ_t``)::

      (I + A) U = diag(b) (V - (K ⊙ γ) S_0),   A_tj = b_t (γ_t / γ_j) k_t·k_j  (j < t)
      O = (Q ⊙ γ) S_0 + (Q Kᵀ ⊙ Γ)_{j<=t} U,     S_C = γ_C S_0 + (K ⊙ γ_C / γ)ᵀ U

  so everything but ``S_0`` is computed for all chunks at once (batched triangular solves
  and matrix products); only ``U = U' - W S_0``, the outputs and the state hand-over run
  chunk after chunk (``chunk_loop``, a PyTorch loop on any device; a fused kernel can
  replace it through ``Chunking.hand_over``).

Performance note: ``C = 64`` and block sizes that are multiples of it keep every
checkpoint of a scheduled chunk inside one segment (one hand-over call per layer and
chunk).

Padding a segment with ``g = 0, b = 0, k = v = q = 0`` leaves the state unchanged, so
segments of any length run on whole chunks.

>>> import torch
>>> T, H, dk, dv = 5, 2, 4, 3
>>> gen = torch.Generator().manual_seed(0)
>>> q, k, v, g, b = random_inputs(T, H, dk, dv, generator=gen)
>>> s0 = torch.randn(H, dk, dv, dtype=torch.float64, generator=gen)
>>> o1, states1 = gated_delta_reference(q, k, v, g, b, s0, stops=[2, 5])
>>> o2, states2 = gated_delta_chunked(q, k, v, g, b, s0, stops=[2, 5], chunking=Chunking(2))
>>> bool(torch.allclose(o1, o2)) and all(torch.allclose(x, y) for x, y in zip(states1, states2))
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as nnf

from hybridkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """One layer's checkpoint: conv inputs ``[K - 1, conv_dim]`` and SSM state
    ``[H, dk, dv]``."""

    conv: torch.Tensor
    ssm: torch.Tensor


def random_inputs(num_tokens: int, num_heads: int, key_dim: int, value_dim: int, *,
                  generator: torch.Generator, dtype: torch.dtype = torch.float64,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Recurrence inputs as the layer makes them: unit keys and queries, ``g`` in
    ``(-2, 0)``, ``b`` in ``(0, 1)`` (tests and benchmarks)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(device, dtype)

    q = nnf.normalize(randn(num_tokens, num_heads, key_dim), dim=-1)
    k = nnf.normalize(randn(num_tokens, num_heads, key_dim), dim=-1)
    v = randn(num_tokens, num_heads, value_dim)
    g = -2.0 * torch.sigmoid(randn(num_tokens, num_heads))
    b = torch.sigmoid(randn(num_tokens, num_heads))
    return q, k, v, g, b


def _check_stops(stops: Sequence[int], num_tokens: int) -> list[int]:
    points = list(stops)
    if not points or points[-1] != num_tokens or any(
            not a < b for a, b in zip([0, *points], points, strict=False)):
        raise ConfigError("stops", points,
                          f"must increase strictly inside (0, {num_tokens}] and end at "
                          f"{num_tokens}")
    return points


def gated_delta_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor, *,
                          stops: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The recurrence token by token.

    Args:
        q, k: ``[T, H, dk]``; v: ``[T, H, dv]``; g (log decay), beta: ``[T, H]``.
        state: ``S_0`` ``[H, dk, dv]`` (not modified).
        stops: token counts ``0 < n_1 < … < n_m = T``; the state after each is returned.

    Returns:
        outputs ``[T, H, dv]`` and one state per stop.
    """
    points = set(_check_stops(stops, q.shape[0]))
    s = state.clone()
    outputs = torch.empty_like(v)
    states: list[torch.Tensor] = []
    for t in range(q.shape[0]):
        kt, vt = k[t], v[t]
        decay = torch.exp(g[t])[:, None, None]
        s = decay * s
        predicted = torch.einsum("hk,hkv->hv", kt, s)
        s = s + torch.einsum("hk,hv->hkv", kt, beta[t][:, None] * (vt - predicted))
        outputs[t] = torch.einsum("hk,hkv->hv", q[t], s)
        if t + 1 in points:
            states.append(s.clone())
    return outputs, states


@dataclass(frozen=True, slots=True)
class ChunkTensors:
    """Everything of the chunked form that does not depend on the state, for ``H`` heads and
    ``n`` chunks of ``C`` tokens: ``qg = Q ⊙ γ``, ``w = T (K ⊙ γ)`` and ``kd = K ⊙ γ_C / γ``
    ``[H, n, C, dk]``; ``attn = (Q Kᵀ ⊙ Γ)`` ``[H, n, C, C]``; ``u_pre = T V``
    ``[H, n, C, dv]``; ``last_decay = γ_C`` ``[H, n]`` (all contiguous)."""

    qg: torch.Tensor
    attn: torch.Tensor
    w: torch.Tensor
    u_pre: torch.Tensor
    kd: torch.Tensor
    last_decay: torch.Tensor


HandOver = Callable[[ChunkTensors, torch.Tensor, Sequence[int]],
                    tuple[torch.Tensor, list[torch.Tensor]]]
"""``(chunks, state [H, dk, dv], saves) -> (outputs [H, n, C, dv], states)``: the
sequential part of the chunked form; ``saves`` are chunk counts ``0 < c_1 < … < c_m = n``
after which the state is returned (see ``chunk_loop``)."""


def chunk_loop(chunks: ChunkTensors, state: torch.Tensor,
               saves: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chunk-by-chunk hand-over in PyTorch (any device)::

        u = u_pre_i - w_i S;   o_i = qg_i S + attn_i u;   S = γ_C,i S + kd_iᵀ u
    """
    s = state
    wanted = set(saves)
    outputs = torch.empty_like(chunks.u_pre)
    states: list[torch.Tensor] = []
    for i in range(chunks.qg.shape[1]):
        u = chunks.u_pre[:, i] - chunks.w[:, i] @ s
        outputs[:, i] = chunks.qg[:, i] @ s + chunks.attn[:, i] @ u
        s = chunks.last_decay[:, i, None, None] * s + chunks.kd[:, i].transpose(-1, -2) @ u
        if i + 1 in wanted:
            states.append(s)
    return outputs, states


@dataclass(frozen=True, slots=True)
class Chunking:
    """How ``gated_delta_chunked`` runs: chunk length and the sequential hand-over
    (``chunk_loop``, or any function of the ``HandOver`` signature)."""

    chunk_tokens: int = 64
    hand_over: HandOver = chunk_loop


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor, *, stops: Sequence[int],
                        chunking: Chunking = Chunking(),
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chunked form; same arguments and results as ``gated_delta_reference``.

    Computes in float64 for float64 inputs, else float32 (outputs cast back to ``v``'s
    dtype, states stay float32). Stops a whole number of chunks into a segment are saved
    by the hand-over; any other stop ends a segment, padded to whole chunks (exact, see the
    module docstring). With chunk-aligned stops (block sizes a multiple of the chunk) one
    segment covers the whole call.
    """
    points = _check_stops(stops, q.shape[0])
    size = chunking.chunk_tokens
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    s = state.to(work)
    outputs = []
    states: list[torch.Tensor] = []
    begin = 0
    saves: list[int] = []
    for stop in points:
        if (stop - begin) % size == 0 and stop != points[-1]:
            saves.append((stop - begin) // size)
            continue
        part = slice(begin, stop)
        out, saved = _segment((q[part], k[part], v[part], g[part], beta[part]), s, chunking,
                              work, saves)
        outputs.append(out)
        states.extend(saved)
        s = saved[-1]
        begin, saves = stop, []
    return torch.cat(outputs).to(v.dtype), states


def _segment(inputs: tuple[torch.Tensor, ...], state: torch.Tensor, chunking: Chunking,
             work: torch.dtype, saves: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v, g, beta = inputs
    chunk = chunking.chunk_tokens
    num_tokens, num_heads = g.shape
    n = -(-num_tokens // chunk)
    pad = n * chunk - num_tokens

    def blocks(x: torch.Tensor) -> torch.Tensor:
        """``[T, H, ...]`` → ``[H, n, C, ...]`` (zero padded)."""
        x = x.to(work)
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        x = x.reshape(n, chunk, *x.shape[1:])
        return x.movedim(2, 0)

    qc, kc, vc, gc, bc = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    gc = gc.cumsum(dim=-1)                                   # log γ_t within each chunk
    diff = gc[..., :, None] - gc[..., None, :]               # log γ_t / γ_j
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))   # Γ, zero above diagonal
    strict = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]
    unit_lower = strict.tril(-1) + torch.eye(chunk, dtype=work, device=q.device)
    rhs = torch.cat([vc * bc[..., None], kc * (bc * torch.exp(gc))[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    u_pre, w = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
    last = gc[..., -1]
    chunks = ChunkTensors(
        qg=(qc * torch.exp(gc)[..., None]).contiguous(),
        attn=((qc @ kc.transpose(-1, -2)) * decay).contiguous(),
        w=w.contiguous(), u_pre=u_pre.contiguous(),
        kd=(kc * torch.exp(last[..., None] - gc)[..., None]).contiguous(),
        last_decay=torch.exp(last).contiguous())
    out, states = chunking.hand_over(chunks, state.contiguous(), [*saves, n])
    out = out.movedim(0, 2).reshape(n * chunk, num_heads, -1)
    return out[:num_tokens], states


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, *,
                stops: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Depthwise causal conv of ``K`` taps (the layer applies SiLU after it).

    Args:
        x: inputs ``[T, C]``; conv_state: the ``K - 1`` inputs before them ``[K - 1, C]``;
        weight: ``[C, K]`` (tap ``K - 1`` multiplies the current input).
        stops: token counts, as for the recurrence; the conv state after each is returned.

    >>> x = torch.arange(1.0, 4.0)[:, None]                  # inputs 1, 2, 3 (one channel)
    >>> y, states = causal_conv(x, torch.zeros(1, 1), torch.tensor([[1.0, 10.0]]), stops=[3])
    >>> [round(float(v), 3) for v in y[:, 0]], states[0].flatten().tolist()
    ([10.0, 21.0, 32.0], [3.0])
    """
    taps = weight.shape[1]
    points = _check_stops(stops, x.shape[0])
    full = torch.cat([conv_state.to(x.dtype), x])            # [K - 1 + T, C]
    windows = full.unfold(0, taps, 1)                        # [T, C, K]
    y = (windows * weight.to(x.dtype)).sum(dim=-1)
    states = [full[stop : stop + taps - 1].clone() for stop in points]
    return y, states
