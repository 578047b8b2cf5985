"""CPU kernels for quantized linear layers (worker_svc/executor/quantize.py applies them).

Each class quantizes one layer's weight with torchao's primitives (``choose_qparams_affine``,
``quantize_affine`` and the tinygemm variants), keeps only the quantized copy in the chosen kernel's
layout, and is called like ``F.linear``. ``ops`` is this project's kernel library (``torch.ops.llmserve_cpu``)
or None for aten's; ``isa`` picks its kernel set: ``"avx2"`` (kernels/csrc/quant_linear_avx2.cpp) or
``"avx512"`` (kernels/csrc/quant_linear_avx512.cpp, weight-only configs, weights packed for 16 outputs per
zmm). ``dequantized()`` gives the fp32 weight the quantized values mean: the reference the tests hold
every kernel set to.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from worker_svc.kernels.row_stable import zero_pad_rows


def _primitives():
    """torchao's quantization primitives, imported on first use: importing torchao takes ~2.7 s here,
    which a worker started without --torchao-config should not pay."""
    with warnings.catch_warnings():  # torchao announces skipped C++ extensions at import
        warnings.simplefilter("ignore")
        from torchao.quantization import quant_primitives
    return quant_primitives


INT4_BLOCK = 64  # the AVX2 int4 layout's block of input features


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, Kp / 2] uint8, the AVX2 int4 kernel's layout (Kp: K rounded up to 64,
    zero-padded): per 64-wide block, eight little-endian 32-bit words, word i holding weight 8t + i of
    the block in bits 4t..4t+3."""
    rows, cols = q.shape
    padded = -(-cols // INT4_BLOCK) * INT4_BLOCK
    q = F.pad(q.to(torch.int64), (0, padded - cols))
    planes = q.view(rows, padded // INT4_BLOCK, 8, 8)  # [N, block, t, i]
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
    words = (planes << shifts).sum(dim=2)  # [N, block, i]: 32-bit values held in int64
    return words.view(torch.uint8).view(rows, -1, 8, 8)[..., :4].reshape(rows, padded // 2).contiguous()


AVX512_OUT = 16  # outputs per zmm in the AVX-512 layouts


def pack_int8_avx512(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [G, Kp / 2, 32] int8 (G = N / 16 rounded up, Kp = K rounded up to even, zero padded):
    per group of 16 outputs and pair of inputs, (n0k0, n0k1, n1k0, n1k1, ...)."""
    rows, cols = q.shape
    groups, pairs = -(-rows // AVX512_OUT), -(-cols // 2)
    q = F.pad(zero_pad_rows(q, groups * AVX512_OUT), (0, 2 * pairs - cols))
    return q.view(groups, AVX512_OUT, pairs, 2).permute(0, 2, 1, 3).reshape(groups, pairs, 2 * AVX512_OUT).contiguous()


def unpack_int8_avx512(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    groups, pairs, _ = packed.shape
    return packed.view(groups, pairs, AVX512_OUT, 2).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:rows, :cols]


def _int4_words(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K a multiple of 8) -> [G, K / 8, 16] int32: word j of block b holds the weight
    (16g + j, 8b + t) in bits 4t..4t+3; output rows beyond N are zero."""
    rows, cols = q.shape
    groups = -(-rows // AVX512_OUT)
    planes = zero_pad_rows(q.to(torch.int64), groups * AVX512_OUT).view(groups, AVX512_OUT, cols // 8, 8)
    words = (planes << (4 * torch.arange(8, dtype=torch.int64))).sum(dim=-1).permute(0, 2, 1)  # [G, K/8, 16]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def pack_int4_avx512(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] values 0..15 with [N, K / group] scale and zero -> [G, K / group, 32 s + 8 group] uint8 (s: the
    scales' element size): per group of 16 outputs and quantization group, the 16 scales, the 16 zeros,
    then the group's weights as ``group / 8`` blocks of 16 words (word j of block b: output 16g + j,
    inputs 8b .. 8b + 7 in bits 4t..4t+3). Output rows beyond N are zero; one output group is one stream."""
    words = _int4_words(q)  # [G, K/8, 16]
    out_groups, quant_groups = words.shape[0], scale.shape[1]
    padded = out_groups * AVX512_OUT
    sz = torch.stack((zero_pad_rows(scale, padded), zero_pad_rows(zero, padded)))  # [2, Np, groups]
    sz = sz.view(2, out_groups, AVX512_OUT, quant_groups).permute(1, 3, 0, 2).contiguous()  # [G, groups, 2, 16]
    head = sz.view(torch.uint8).reshape(out_groups, quant_groups, -1)
    body = words.view(out_groups, quant_groups, -1).view(torch.uint8)  # [G, groups, 64 * group / 8]
    return torch.cat((head, body), dim=-1).contiguous()


def unpack_int4_avx512(
    packed: torch.Tensor, rows: int, group: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_int4_avx512``'s inverse: ([N, K] uint8 values, [N, K / group] scale, zero)."""
    out_groups, quant_groups, _ = packed.shape
    head = 2 * AVX512_OUT * torch.finfo(scale_dtype).bits // 8
    sz = packed[..., :head].contiguous().view(scale_dtype).view(out_groups, quant_groups, 2, AVX512_OUT)
    both = sz.permute(2, 0, 3, 1).reshape(2, -1, quant_groups)[:, :rows]  # [2, N, groups]
    words = packed[..., head:].contiguous().view(torch.int32).view(out_groups, -1, AVX512_OUT).to(torch.int64)
    words &= 0xFFFFFFFF
    q = (words[..., None] >> (4 * torch.arange(8, dtype=torch.int64))) & 0xF  # [G, K/8, 16, t]
    q = q.permute(0, 2, 1, 3).reshape(out_groups * AVX512_OUT, -1)[:rows].to(torch.uint8)
    return q, both[0], both[1]


def _check_isa(isa: str) -> None:
    if isa not in ("avx2", "avx512"):
        raise ValueError(f"isa must be avx2 or avx512, not {isa!r}")


def unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    rows = packed.shape[0]
    word_bytes = packed.view(rows, -1, 8, 4).to(torch.int64)  # [N, block, i, byte]
    words = (word_bytes << (8 * torch.arange(4, dtype=torch.int64))).sum(dim=-1)  # [N, block, i]
    planes = (
        words[:, :, None, :] >> (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
    ) & 0xF  # [N, block, t, i]
    return planes.reshape(rows, -1)[:, :cols].to(torch.uint8)


class Int8WeightOnlyKernel:
    """Per-output-channel symmetric int8 weights; activations stay in the model dtype.

    ``row_absmax`` ([out]) overrides the channel range: a row-parallel shard passes the max over
    all ranks, so its scales, and hence its quantized values, equal an unsharded quantization.
    ``ops``: this project's kernels (``isa`` "avx2" or "avx512"), or None for aten's.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        dtype: torch.dtype,
        row_absmax: torch.Tensor | None = None,
        ops=None,
        isa: str = "avx2",
    ) -> None:
        _check_isa(isa)
        self.ops = ops
        self.avx512 = ops is not None and isa == "avx512"
        self.out_features, self.in_features = weight.shape
        w32 = weight.float()
        self.block = (1, w32.shape[1])
        if row_absmax is None:
            self.scale, self.zero = _primitives().choose_qparams_affine(
                w32,
                _primitives().MappingType.SYMMETRIC,
                self.block,
                torch.int8,
                -127,
                127,
                eps=1e-9,
                scale_dtype=torch.float32,
            )
        else:  # choose_qparams_affine's symmetric rule, on the all-rank range
            self.scale = (row_absmax.float() / 127).clamp(min=1e-9).reshape(-1, 1)
            self.zero = torch.zeros_like(self.scale, dtype=torch.int32)
        qweight = _primitives().quantize_affine(
            w32, self.block, self.scale, self.zero, torch.int8, -127, 127
        )  # [N, K]
        # [N]: aten's kernel takes the scales in the activation dtype, this project's in float32.
        self.kernel_scale = self.scale.reshape(-1).to(torch.float32 if ops is not None else dtype).contiguous()
        self.qweight: torch.Tensor | None = qweight
        if self.avx512:  # the packed copy replaces the row-major one
            self.packed = pack_int8_avx512(qweight)  # [G, Kp / 2, 32]
            self.kernel_scale = zero_pad_rows(self.kernel_scale, self.packed.shape[0] * AVX512_OUT)
            self.qweight = None
        weight_bytes = self.packed.numel() if self.avx512 else qweight.numel()
        self.nbytes = weight_bytes + self.kernel_scale.numel() * self.kernel_scale.element_size()

    def quantized_weight(self) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight
        return unpack_int8_avx512(self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        return _primitives().dequantize_affine(
            self.quantized_weight(), self.block, self.scale, self.zero, torch.int8, -127, 127
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.avx512:  # one call: leading dims and the bias are handled inside
            return self.ops.int8_weight_linear_avx512(x, self.packed, self.kernel_scale, self.out_features, bias)
        x2 = x.reshape(-1, x.shape[-1])  # [rows, in]
        if self.ops is not None:
            out = self.ops.int8_weight_linear(x2, self.qweight, self.kernel_scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.kernel_scale)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Int4WeightOnlyKernel:
    """Grouped asymmetric uint4 weights in tinygemm's convention (w = (q - 8) * scale + zero, scale and
    zero in the model dtype), stored for the chosen kernel:

    - AVX2: ``pack_nibbles`` layout [out, in / 2] (in padded to a multiple of 64) with scale and zero
      [out, in / group].
    - AVX-512: ``pack_int4_avx512``: per 16 outputs and quantization group, their scales and zeros, then
      their nibbles in 32-bit words (out rounded up to 16 with zero rows), one uint8 tensor.
    - aten: ``_convert_weight_to_int4pack_for_cpu``'s layout, which needs a multiple of 16 output rows;
      other sizes (MLA's kv_a_proj_with_mqa is kv_lora_rank + rope, 40 in the tiny DeepSeek preset) get
      zero rows appended, sliced off the output.
    """

    PACK_ROWS = 16

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group_size: int, ops=None, isa: str = "avx2") -> None:
        _check_isa(isa)
        self.ops = ops
        self.avx512 = ops is not None and isa == "avx512"
        w32 = weight.float()
        self.out_features, in_features = w32.shape
        pad = 0 if ops is not None else -self.out_features % self.PACK_ROWS
        if pad:
            w32 = torch.cat((w32, w32.new_zeros(pad, in_features)))
        self.block = (1, group_size)
        self.group_size = group_size
        qp = _primitives()
        scale, zero = qp._choose_qparams_affine_tinygemm(
            w32,
            qp.MappingType.ASYMMETRIC,
            self.block,
            torch.int32,
            0,
            15,
            eps=1e-6,
            scale_dtype=dtype,
            zero_point_dtype=dtype,
        )
        qweight = qp._quantize_affine_tinygemm(w32, self.block, scale, zero, torch.int32, 0, 15)  # [N, K] 0..15
        groups = in_features // group_size
        self.scale = scale.reshape(-1, groups).contiguous()  # [N, groups]
        self.zero = zero.reshape(-1, groups).contiguous()
        if self.avx512:  # the packed copy replaces the row-major ones
            self.scale_dtype = dtype
            self.packed = pack_int4_avx512(qweight, self.scale, self.zero, group_size)
            del self.scale, self.zero
            self.nbytes = self.packed.numel()
            return
        if ops is not None:
            self.packed = pack_nibbles(qweight)  # [N, K / 2]
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qweight, 1)
            # [in / group, out, 2]: per group and output channel, (scale, zero).
            self.scale_and_zero = torch.stack((self.scale.t(), self.zero.t()), dim=-1).contiguous()
        self.nbytes = (
            self.packed.numel() * self.packed.element_size() + 2 * self.scale.numel() * self.scale.element_size()
        )

    def dequantized(self) -> torch.Tensor:
        if self.avx512:
            q, scale, zero = unpack_int4_avx512(self.packed, self.out_features, self.group_size, self.scale_dtype)
            return _primitives()._dequantize_affine_tinygemm(
                q.to(torch.int32), self.block, scale, zero, torch.int32, 0, 15
            ).float()
        if self.ops is not None:
            qweight = unpack_nibbles(self.packed, self.scale.shape[1] * self.group_size).to(torch.int32)
            w = _primitives()._dequantize_affine_tinygemm(
                qweight, self.block, self.scale, self.zero, torch.int32, 0, 15
            )
            return w.float()
        # aten's packed layout is opaque: run the kernel on the identity, in float32, to read W^T.
        in_features = self.scale.shape[1] * self.group_size
        eye = torch.eye(in_features, dtype=torch.float32)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scale_and_zero.float())
        return w_t.t()[: self.out_features].contiguous()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.avx512:  # one call: leading dims and the bias are handled inside
            return self.ops.int4_weight_linear_avx512(
                x, self.packed, self.out_features, self.group_size, self.scale_dtype, bias
            )
        x2 = x.reshape(-1, x.shape[-1])  # [rows, in]
        if self.ops is not None:
            out = self.ops.int4_weight_linear(x2, self.packed, self.scale, self.zero, self.group_size)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_and_zero)
            if out.shape[-1] != self.out_features:
                out = out[:, : self.out_features].contiguous()
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Int8DynamicKernel(Int8WeightOnlyKernel):
    """int8 weights (per channel) x int8 activations quantized per token at run time (aten's or the AVX2
    kernel: the AVX-512 set has none)."""

    def __init__(
        self,
        weight: torch.Tensor,
        dtype: torch.dtype,
        row_absmax: torch.Tensor | None = None,
        ops=None,
        isa: str = "avx2",
    ) -> None:
        if ops is not None and isa != "avx2":
            raise ValueError("int8dq runs aten's kernel or the AVX2 one; there is no AVX-512 int8dq kernel")
        super().__init__(weight, dtype, row_absmax, ops, isa)

    @staticmethod
    def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
        """What the kernel's activation quantization means, in fp32 (for the reference)."""
        x2 = x.float()
        x_scale = (x2.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-9)
        return torch.round(x2 / x_scale).clamp(-127, 127) * x_scale

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.ops is not None:
            out = self.ops.int8_dynamic_linear(x.reshape(-1, x.shape[-1]), self.qweight, self.kernel_scale)
            if bias is not None:
                out = out + bias
            return out.reshape(*x.shape[:-1], out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).float()  # [rows, in]
        x_scale = (x2.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-9)  # [rows, 1]
        xq = torch.round(x2 / x_scale).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self.quantized_weight().t())  # [rows, out] int32
        out = (acc.float() * x_scale * self.scale.reshape(1, -1)).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
