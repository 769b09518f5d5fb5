"""The inference form of a trained module: the same function in a handful of kernels per layer.

Decoding evaluates the module at every layer for every token, where launch overhead, not
arithmetic, is the cost (docs/design.md §12). ``fuse_module`` rewrites each layer once, at load time:

* the per-head normalisation of q is folded into every weight that reads q, and that of the
  outputs (α and A) into the output layers: qn·M + c = q·(M/σ_q) + (c − (μ_q/σ_q)·M) and
  (h·W + c)·σ + μ = h·(W·σ) + (c·σ + μ) — no normalisation kernels remain;
* every map applied to q — U_0 of a network whose input is q and V_k q of every hidden layer of
  the backbone, score and target networks (with their biases) — is ONE batched GEMM over all KV
  heads, P = q·[U_0 | V_1 | … ] + [b_0 | b_1 | …]; each hidden layer is then one baddbmm
  (pre_k = P_k + h_k·U_k, bias and q-term fused) and one SiLU;
* the score and target networks run as ONE chain when they have the same depth and no layer norm
  (the default (0, 4, 4)): their hidden states are concatenated, [h_s | h_t], and each U_k is the
  block-diagonal diag(U_k^s, U_k^t), so a hidden layer of both networks is one baddbmm + one SiLU
  and both output layers are one GEMM. Their widths differ (the 10/90 budget split), so the zero
  blocks cost about 1.4x the U_k bytes (10-25 % of the module, still a few % of the KV it
  replaces) for half the kernels — on a GPU the kernel count, not these bytes, is what is far from
  the bound. Other architectures run the two chains one after the other;
* weights are kept in the model's dtype (bf16/fp16 on GPU, where the GEMMs accumulate in fp32);
  the output layers run in float32, so the log-mass a — the merge weight — is fp32;
* a quadrature module stored at ``bits`` < 32 (``train.module.bits``) keeps W, Z, β as packed codes.
  With ``keep_dequantized`` (the default) they are dequantized ONCE, at load, and the float weights
  kept beside the codes: a decode step reads floats (``resident_bytes`` counts both, what a server's
  LRU bound charges). Without it only the codes are held and every call dequantizes them (unpack,
  scale, pad the ragged heads: half of a batch-1 CPU step for the cpu default, docs/deployment.md
  §13) — for memory-tight deployments. An MLP module's parameters already sit on their quantization
  grid (modules/stored.py) and are folded as floats (its folds mix weights, so they can't stay packed).

Training keeps ``LayerMLP`` (differentiable, parameters in normalised space); the fused form is a
snapshot for inference and must be rebuilt after the weights change. ``FusedModule.predict`` equals
``NectarModule.predict`` to float32 rounding (tests/modules/test_fused.py states the tolerance).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quantization import QuantizedTensor, dequantize, quantize, storage_bits

from .budget import SkipMLPShape
from .builder import NectarModule
from .mlp import LayerMLP
from .quadrature import LayerQuadrature
from .stored import padded, ragged


@dataclass
class _Hidden:
    """One hidden layer k of a chain: where its q-term sits in P, and its U_k (None when k = 0 and the
    chain reads q: then pre_k is P's slice alone)."""

    q_slice: slice | None  # columns of P holding V_k q + b_k (or U_0 q + b_0)
    U: torch.Tensor | None  # [H, w, w] (or [H, in, w] for k = 0 on the backbone's output)
    bias: torch.Tensor | None  # [H, 1, w] when the layer has no q-term (k = 0 reading h_b)
    ln: tuple[torch.Tensor, torch.Tensor] | None  # layer-norm gain, bias [H, 1, w]


@dataclass
class _Chain:
    hidden: list[_Hidden]
    width: int
    out_W: torch.Tensor | None  # [H, w_or_in, out] (normalisation folded); None: no output layer
    out_b: torch.Tensor | None  # [H, 1, out]
    out_q_slice: slice | None  # a depth-0 head reading q: its output is P's slice


class FusedLayerMLP:
    def __init__(self, layer: LayerMLP, norm: dict[str, torch.Tensor], dtype: torch.dtype):
        s, p = layer.shapes, {k: v.detach().float() for k, v in layer.named_parameters()}
        self.residual, self.dtype = layer.residual, dtype
        mu, sd = norm["q_mean"], norm["q_std"]  # [H, d], [H]
        q_mats: list[torch.Tensor] = []  # folded [H, d, w] blocks of P's weight
        q_bias: list[torch.Tensor] = []  # [H, w]
        col = 0

        def q_term(M: torch.Tensor, c: torch.Tensor, out_scale=None, out_shift=None) -> slice:
            nonlocal col
            M2 = M / sd[:, None, None]  # [H, d, w]
            c2 = c - torch.einsum("hd,hdw->hw", mu / sd[:, None], M)
            if out_scale is not None:  # a depth-0 output layer reading q: fold the output too
                M2, c2 = M2 * out_scale[:, None, None], c2 * out_scale[:, None] + out_shift
            q_mats.append(M2)
            q_bias.append(c2)
            col += M.shape[-1]
            return slice(col - M.shape[-1], col)

        def chain(prefix: str, shape: SkipMLPShape, reads_q: bool, out_scale=None, out_shift=None) -> _Chain:
            hidden = []
            for k in range(shape.depth):
                ln = ((p[f"{prefix}_ln{k}_g"].unsqueeze(1).to(dtype), p[f"{prefix}_ln{k}_b"].unsqueeze(1).to(dtype))
                      if shape.layer_norm else None)
                if k == 0 and reads_q:
                    hidden.append(_Hidden(q_term(p[f"{prefix}_U0"], p[f"{prefix}_b0"]), None, None, ln))
                elif k == 0:
                    hidden.append(_Hidden(None, p[f"{prefix}_U0"].to(dtype),
                                          p[f"{prefix}_b0"].unsqueeze(1).to(dtype), ln))
                else:
                    hidden.append(_Hidden(q_term(p[f"{prefix}_V{k}"], p[f"{prefix}_b{k}"]),
                                          p[f"{prefix}_U{k}"].to(dtype), None, ln))
            if shape.out_dim is None:
                return _Chain(hidden, shape.width, None, None, None)
            W, c = p[f"{prefix}_Wout"], p[f"{prefix}_bout"]
            if shape.depth == 0 and reads_q:
                return _Chain(hidden, shape.width, None, None, q_term(W, c, out_scale, out_shift))
            W, c = W * out_scale[:, None, None], c * out_scale[:, None] + out_shift  # output normalisation
            return _Chain(hidden, shape.width, W, c.unsqueeze(1), None)

        self.backbone = chain("backbone", s.backbone, True) if s.backbone.depth else None
        heads_read_q = self.backbone is None
        a_scale, a_shift = norm["alpha_std"], norm["alpha_mean"][:, None]
        self.merged: _Chain | None = None
        self.score = self.target = None
        if s.score.depth == s.target.depth > 0 and not s.score.layer_norm:
            self.merged = self._merge(p, s.score.depth, heads_read_q, q_term, (a_scale, a_shift),
                                      (norm["A_std"], norm["A_mean"]), dtype)
        else:
            self.score = chain("score", s.score, heads_read_q, a_scale, a_shift)
            self.target = chain("target", s.target, heads_read_q, norm["A_std"], norm["A_mean"])
            for c in (self.score, self.target):  # output layers in float32 (a is the merge weight)
                if c.out_W is not None:
                    c.out_W, c.out_b = c.out_W.float(), c.out_b.float()
        self.q_W = torch.cat(q_mats, dim=-1).to(dtype)  # [H, d, ΣW]: every q-term of the layer
        self.q_b = torch.cat(q_bias, dim=-1).unsqueeze(1).to(dtype)  # [H, 1, ΣW]

    @staticmethod
    def _merge(p, depth, reads_q, q_term, score_norm, target_norm, dtype) -> _Chain:
        """Score and target as one chain over [h_s | h_t] (block-diagonal U_k and output layer)."""
        hidden = []
        for k in range(depth):
            if k == 0 and reads_q:
                sl = q_term(torch.cat([p["score_U0"], p["target_U0"]], -1),
                            torch.cat([p["score_b0"], p["target_b0"]], -1))
                hidden.append(_Hidden(sl, None, None, None))
            elif k == 0:  # both read the backbone's output: U_0 side by side, not block-diagonal
                U = torch.cat([p["score_U0"], p["target_U0"]], -1).to(dtype)
                b = torch.cat([p["score_b0"], p["target_b0"]], -1).unsqueeze(1).to(dtype)
                hidden.append(_Hidden(None, U, b, None))
            else:
                sl = q_term(torch.cat([p[f"score_V{k}"], p[f"target_V{k}"]], -1),
                            torch.cat([p[f"score_b{k}"], p[f"target_b{k}"]], -1))
                hidden.append(_Hidden(sl, _block_diag(p[f"score_U{k}"], p[f"target_U{k}"]).to(dtype), None, None))
        (sa, ma), (sA, mA) = score_norm, target_norm
        W = _block_diag(p["score_Wout"] * sa[:, None, None], p["target_Wout"] * sA[:, None, None])  # [H, ws+wt, 1+d]
        b = torch.cat([p["score_bout"] * sa[:, None] + ma, p["target_bout"] * sA[:, None] + mA], -1)
        width = p["score_U0"].shape[-1] + p["target_U0"].shape[-1]
        return _Chain(hidden, width, W.float(), b.unsqueeze(1).float(), None)

    def to(self, device: torch.device) -> "FusedLayerMLP":
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
            elif isinstance(value, _Chain):
                _chain_to(value, device)
        return self

    def _run(self, c: _Chain, P: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        """One chain over P [H, N, ΣW] (its q-terms) and x (the backbone output, if it reads one)."""
        h = x
        for k, layer in enumerate(c.hidden):
            if layer.U is None:
                pre = P[..., layer.q_slice]
            elif layer.q_slice is None:
                pre = torch.baddbmm(layer.bias, h, layer.U)  # [H, N, w]
            else:
                pre = torch.baddbmm(P[..., layer.q_slice], h, layer.U)  # V_k q + b_k + U_k h_k
            if layer.ln is not None:
                pre = F.layer_norm(pre, (c.width,)) * layer.ln[0] + layer.ln[1]
            act = F.silu(pre)
            h = h + act if (self.residual and k > 0) else act
        if c.out_q_slice is not None:
            return P[..., c.out_q_slice]
        if c.out_W is None:
            return h
        return torch.baddbmm(c.out_b, h.to(c.out_W.dtype), c.out_W)

    def __call__(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [H, N, d] raw rotated queries, head-major → (A [H, N, d], a [H, N] float32), raw units."""
        q = q.to(self.dtype)
        P = torch.baddbmm(self.q_b, q, self.q_W)  # [H, N, ΣW]: all q-terms, one GEMM
        x = self._run(self.backbone, P, None) if self.backbone is not None else None
        if self.merged is not None:
            y = self._run(self.merged, P, x)  # [H, N, 1 + d] float32: [a | A]
            return y[..., 1:], y[..., 0]
        a = self._run(self.score, P, x)[..., 0].float()  # [H, N]
        A = self._run(self.target, P, x)  # [H, N, d]
        return A, a


class FusedLayerQuadrature:
    """a = LSE(s·Wq + β), A = softmax(s·Wq + β)ᵀZ with the scaling folded into W and β the GEMM's
    bias input; logits and lse in fp32.

    A module stored at ``bits`` < 32 is served from its stored form: W, Z and β stay packed integer
    codes with fp16 scales and zeros (nectar/quantization.py). ``keep_dequantized``: their float form
    is computed once (at construction and after ``to``) and kept in ``dequantized``; otherwise every
    call dequantizes (``dequantizations`` counts the dequantizations of this layer)."""

    def __init__(self, layer: LayerQuadrature, dtype: torch.dtype, bits: int = 32, group: int = 64,
                 counts: tuple[int, ...] = (), bias_stored: bool = True, keep_dequantized: bool = True):
        self.dtype, self.scaling = dtype, layer.scaling
        beta = layer.beta.detach().float() if layer.beta is not None else None
        self.packed: tuple[Stored, Stored, Stored | None] | None = None
        self.keep_dequantized, self.dequantizations = keep_dequantized, 0
        # (W·s transposed [H, d, p], Z [H, p, d], β [H, 1, p]) kept from the codes (keep_dequantized)
        self.dequantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.counts, self.width = tuple(counts), layer.W.shape[1]  # heads of different widths: real pairs each
        if bits < 32 and self.counts:  # only the real pairs, as stored (modules/stored.py): β at bf16
            self.packed = (_stored(ragged(layer.W.detach().float(), self.counts), bits, group),
                           _stored(ragged(layer.Z.detach().float(), self.counts), bits, group),
                           ragged(beta, self.counts).to(torch.bfloat16) if beta is not None and bias_stored else None)
            self.Wt = self.Z = self.beta = self._zero_beta = None
            self._keep()
            return
        if bits < 32:
            self.packed = (_stored(layer.W.detach().float(), bits, group), _stored(layer.Z.detach().float(), bits, group),
                           _stored(beta, bits, group) if beta is not None else None)
            self.Wt = self.Z = self.beta = None
            self._zero_beta = None if beta is not None else torch.zeros(layer.W.shape[0], 1, layer.W.shape[1])
            self._keep()
            return
        self.Wt = (layer.W.detach().float() * layer.scaling).transpose(1, 2).contiguous().to(dtype)  # [H, d, p]
        self.Z = layer.Z.detach().to(dtype)  # [H, p, d]
        beta = beta if beta is not None else torch.zeros(layer.W.shape[:2])
        self.beta = beta.unsqueeze(1).float()  # [H, 1, p]

    def to(self, device: torch.device) -> "FusedLayerQuadrature":
        if self.packed is not None:
            self.packed = tuple(_stored_to(q, device) if q is not None else None for q in self.packed)
            self._zero_beta = self._zero_beta.to(device) if self._zero_beta is not None else None
            if self.dequantized is not None:
                self.dequantized = tuple(t.to(device) for t in self.dequantized)
            return self
        self.Wt, self.Z, self.beta = self.Wt.to(device), self.Z.to(device), self.beta.to(device)
        return self

    def _keep(self) -> None:
        if self.keep_dequantized:
            self.dequantized = tuple(t.contiguous() for t in self._dequantize())

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W·s transposed [H, d, p], Z [H, p, d]) in the layer dtype and β [H, 1, p] float32."""
        if self.packed is None:
            return self.Wt, self.Z, self.beta
        if self.dequantized is not None:
            return self.dequantized
        return self._dequantize()

    def _dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights from the packed codes (what ``_weights`` returns)."""
        self.dequantizations += 1
        qW, qZ, qb = self.packed
        if self.counts:  # real pairs back to back → [H, width, ·], masked slots W = Z = 0, β = −inf
            W = padded(_values(qW), self.counts, self.width, 0.0)
            real = qb.float() if qb is not None else torch.zeros(sum(self.counts), device=W.device)
            beta = padded(real, self.counts, self.width, float("-inf")).unsqueeze(1)  # [H, 1, p]
            Wt = (W * self.scaling).transpose(1, 2).to(self.dtype)  # [H, d, p]
            return Wt, padded(_values(qZ), self.counts, self.width, 0.0).to(self.dtype), beta
        Wt = (_values(qW) * self.scaling).transpose(1, 2).to(self.dtype)  # [H, d, p]
        beta = _values(qb).unsqueeze(1) if qb is not None else self._zero_beta  # [H, 1, p]
        return Wt, _values(qZ).to(self.dtype), beta

    def __call__(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = q.to(self.dtype)
        Wt, Z, beta = self._weights()
        if self.dtype == torch.float32:
            logits = torch.baddbmm(beta, q, Wt)  # [H, N, p], β added by the GEMM
        else:  # 16-bit weights: logits and β in float32
            logits = torch.bmm(q, Wt).float() + beta
        # one exp serves both: a = m + log Σ e and A = (e / Σ e)·Z with e = exp(logits − m), in place
        # (logsumexp then softmax exponentiated the [H, N, p] logits twice: 19 % of the layer's time)
        m = logits.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # [H, N, 1]; all −inf: a = −inf
        e = logits.sub_(m).exp_()  # [H, N, p]
        s = e.sum(-1, keepdim=True)  # [H, N, 1]
        a = (s.log() + m).squeeze(-1)  # [H, N] = logsumexp(logits)
        if self.dtype == torch.float32:
            return torch.bmm(e, Z).div_(s), a  # [H, N, d]: normalised after the GEMM (N·d, not N·p, divisions)
        return torch.bmm(e.div_(s).to(self.dtype), Z), a


Stored = QuantizedTensor | torch.Tensor  # packed codes, or float32 where codes would not save bytes


def _stored(t: torch.Tensor, bits: int, group: int) -> Stored:
    return quantize(t, bits, group) if storage_bits(t.shape, bits, group) < 32 else t


def _values(x: Stored) -> torch.Tensor:
    return dequantize(x) if isinstance(x, QuantizedTensor) else x


def _stored_to(x: Stored, device: torch.device) -> Stored:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return dataclasses.replace(x, codes=x.codes.to(device), scales=x.scales.to(device), zeros=x.zeros.to(device))


class FusedModule:
    """Every layer of a module in inference form; ``predict`` takes head-major queries."""

    def __init__(self, layers: list, num_kv_heads: int, head_dim: int, scaling: float, nbytes: int,
                 resident_bytes: int | None = None):
        self.layers, self.num_kv_heads, self.head_dim, self.scaling = layers, num_kv_heads, head_dim, scaling
        self.nbytes = nbytes  # bytes read per evaluation of all layers (the bandwidth bound's term)
        # bytes held: the codes AND the floats kept from them (keep_dequantized), what a server's LRU charges
        self.resident_bytes = nbytes if resident_bytes is None else resident_bytes

    @property
    def dequantizations(self) -> int:
        """Dequantizations of packed codes so far, all layers (one per quantized layer at load when the
        floats are kept; one per layer per call when not)."""
        return sum(getattr(layer, "dequantizations", 0) for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def predict(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [H, N, d] → (A [H, N, d], a [H, N] float32) in raw units."""
        return self.layers[layer](q)


@torch.no_grad()
def fuse_module(module: NectarModule, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, keep_dequantized: bool = True) -> FusedModule:
    """The inference form of ``module`` (weights in ``dtype``, default the module's own).
    ``keep_dequantized``: a quantized module's float weights are computed once and kept beside its
    codes (False: codes only, dequantized at every call)."""
    param = next(module.parameters())
    dtype = dtype or param.dtype
    device = torch.device(device) if device is not None else param.device
    layers = []
    for i, layer in enumerate(module.layers):
        if isinstance(layer, LayerQuadrature):
            counts = module.head_pairs[i] if module.head_pairs else ()
            layers.append(FusedLayerQuadrature(layer, dtype, module.bits, module.quant_group, counts,
                                               module.bias_stored, keep_dequantized).to(device))
        else:
            norm = {name: getattr(module, name)[i].detach().float() for name in
                    ("q_mean", "q_std", "alpha_mean", "alpha_std", "A_mean", "A_std")}
            layers.append(FusedLayerMLP(layer, norm, dtype).to(device))
    nbytes = sum(_tensor_bytes(layer, reads=True) for layer in layers)
    resident = sum(_tensor_bytes(layer, reads=False) for layer in layers)
    return FusedModule(layers, module.num_kv_heads, module.head_dim, module.scaling, nbytes, resident)


def _block_diag(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[H, i1, o1], [H, i2, o2] → [H, i1 + i2, o1 + o2] with a and b on the diagonal, zeros elsewhere."""
    H, i1, o1 = a.shape
    out = a.new_zeros(H, i1 + b.shape[1], o1 + b.shape[2])
    out[:, :i1, :o1] = a
    out[:, i1:, o1:] = b
    return out


def _chain_to(c: _Chain, device: torch.device) -> None:
    for layer in c.hidden:
        layer.U = layer.U.to(device) if layer.U is not None else None
        layer.bias = layer.bias.to(device) if layer.bias is not None else None
        layer.ln = tuple(t.to(device) for t in layer.ln) if layer.ln is not None else None
    c.out_W = c.out_W.to(device) if c.out_W is not None else None
    c.out_b = c.out_b.to(device) if c.out_b is not None else None


def _tensor_bytes(layer, reads: bool) -> int:
    """Bytes of the layer's tensors: those a call reads (``reads``: the kept floats, not the codes
    they came from), or every tensor it holds."""
    seen: list[torch.Tensor] = []
    if reads and getattr(layer, "dequantized", None) is not None:
        walk_from = [v for k, v in vars(layer).items() if k != "packed"]
    else:
        walk_from = list(vars(layer).values())

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            seen.append(obj)
        elif isinstance(obj, QuantizedTensor):
            seen.extend((obj.codes, obj.scales, obj.zeros))
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif isinstance(obj, (_Chain, _Hidden, FusedLayerMLP, FusedLayerQuadrature)):
            for x in vars(obj).values():
                walk(x)

    walk(walk_from)
    unique = {id(t): t for t in seen}.values()  # a tensor held twice (a shared zero β) counts once
    return sum(t.numel() * t.element_size() for t in unique)
