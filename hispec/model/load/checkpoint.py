"""Load Hugging Face model folders (safetensors, single or sharded) into ``DecoderModel``.

Config and every tensor shape are validated; a mismatch names the tensor and both shapes.
Pickle checkpoints (``.bin``, ``.pt``) are refused unless ``allow_pickle=True`` is passed,
and even then they are read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ... import envs
from ...config import ConfigError, ModelConfig, check_engine_options
from ...kernels import hugepages
from ..decoder import DecoderModel


class ModelLoadError(RuntimeError):
    """The model folder cannot be loaded; the message says what is wrong."""


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# HF name (after stripping "model." / "model.decoder." / "decoder.") -> (internal name, fused part)
_LAYER_RULES: list[tuple[str, str, str | None]] = [
    (r"input_layernorm\.(weight|bias)", "input_norm.{0}", None),
    (r"self_attn_layer_norm\.(weight|bias)", "input_norm.{0}", None),
    (r"post_attention_layernorm\.(weight|bias)", "post_norm.{0}", None),
    (r"final_layer_norm\.(weight|bias)", "post_norm.{0}", None),
    (r"self_attn\.(q|k|v)_proj\.(weight|bias)", "qkv_proj.{1}", "{0}"),
    (r"self_attn\.(?:o_proj|out_proj)\.(weight|bias)", "o_proj.{0}", None),
    (r"self_attn\.(q|k)_norm\.weight", "{0}_norm.weight", None),
    (r"mlp\.(gate|up)_proj\.weight", "gate_up_proj.weight", "{0}"),
    (r"mlp\.down_proj\.weight", "down_proj.weight", None),
    (r"(fc1|fc2)\.(weight|bias)", "{0}.{1}", None),
]
_TOP_RULES = {
    "embed_tokens.weight": "embed_tokens.weight",
    "embed_positions.weight": "embed_positions.weight",
    "norm.weight": "norm.weight",
    "final_layer_norm.weight": "norm.weight",
    "final_layer_norm.bias": "norm.bias",
    "project_in.weight": "project_in.weight",
    "project_out.weight": "project_out.weight",
    "lm_head.weight": "lm_head.weight",
}
# Gemma 3 names its norms after where they sit: the one after attention is on its output
_GEMMA3_RULES: list[tuple[str, str, str | None]] = [
    (r"post_attention_layernorm\.weight", "attn_out_norm.weight", None),
    (r"pre_feedforward_layernorm\.weight", "post_norm.weight", None),
    (r"post_feedforward_layernorm\.weight", "mlp_out_norm.weight", None),
]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
FUSED_ORDER = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def internal_name(hf_name: str, family: str = "llama") -> tuple[str, str | None] | None:
    """Map a Hugging Face tensor name of a ``family`` model to ``(internal name, fused part)``; None if unknown."""
    name = re.sub(r"^(model\.)?(language_model\.)?(decoder\.)?", "", hf_name)
    if name in _TOP_RULES:
        return _TOP_RULES[name], None
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m:
        return None
    layer, rest = m.groups()
    for pattern, target, part in (_GEMMA3_RULES if family == "gemma3" else []) + _LAYER_RULES:
        pm = re.fullmatch(pattern, rest)
        if pm:
            return f"layers.{layer}." + target.format(*pm.groups()), part.format(*pm.groups()) if part else None
    return None


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ModelLoadError(f"{cfg_file} lacks the field {e.args[0]!r}") from None


def _weight_files(path: Path, allow_pickle: bool) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not allow_pickle:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({', '.join(p.name for p in pickles)}); unpickling can run "
            "arbitrary code, so hispec refuses it. Convert the weights to safetensors, or pass "
            "--allow-pickle if you trust the file.")
    if pickles:
        return pickles
    raise ModelLoadError(f"{path} has no weights (*.safetensors)")


def _iter_tensors(files: list[Path]):
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        else:
            for name, t in torch.load(str(f), map_location="cpu", weights_only=True).items():
                yield name, t


def ignored(hf_name: str, cfg: ModelConfig) -> bool:
    """A checkpoint tensor the model does not load (RoPE tables, a tied output head)."""
    return bool(_IGNORED.match(hf_name)) or (hf_name.endswith("lm_head.weight") and cfg.tie_word_embeddings)


def expected_shape(model: DecoderModel, shapes: dict[str, tuple[int, ...]], name: str,
                   part: str | None) -> tuple[int, ...]:
    """The shape a checkpoint tensor must have: ``shapes[name]``, or a fused tensor's ``part``."""
    return _expected_part_shapes(model, name)[part] if part else shapes[name]


def fuse_parts(parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Fused tensors (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up) from their parts, in order."""
    fused = {}
    for name, got in parts.items():
        order = FUSED_ORDER[name.split(".")[2]]
        missing = [p for p in order if p not in got]
        if missing:
            raise ModelLoadError(f"missing tensor(s) for {name}: {', '.join(missing)} projection")
        fused[name] = torch.cat([got[p] for p in order], dim=0)
    return fused


def _expected_part_shapes(model: DecoderModel, name: str) -> dict[str, tuple[int, ...]]:
    cfg = model.cfg
    full = tuple(model.state_dict()[name].shape)
    if "qkv_proj" in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {"q": (q,) + full[1:], "k": (kv,) + full[1:], "v": (kv,) + full[1:]}
    return {"gate": (cfg.intermediate_size,) + full[1:], "up": (cfg.intermediate_size,) + full[1:]}


def load_weights(model: DecoderModel, files: list[Path], dtype: torch.dtype) -> None:
    """Fill ``model`` (on the meta device) from checkpoint files, validating every shape."""
    fill_weights(model, _iter_tensors(files), dtype)


def fill_weights(model: DecoderModel, tensors, dtype: torch.dtype, elsewhere: frozenset[str] = frozenset()) -> None:
    """Fill ``model`` (on the meta device) from ``(Hugging Face name, tensor)`` pairs, validating every
    shape; ``elsewhere``: internal names whose modules the caller puts in place itself (a GGUF file's
    own blocks), not expected among the pairs and left on the meta device."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for hf_name, tensor in tensors:
        mapped = internal_name(hf_name, model.cfg.family)
        if mapped is None or mapped[0] not in expected:
            if ignored(hf_name, model.cfg):
                continue
            raise ModelLoadError(f"unexpected tensor {hf_name!r} (shape {tuple(tensor.shape)}) for a "
                                 f"{model.cfg.family} model with {model.cfg.num_layers} layers")
        name, part = mapped
        want = expected_shape(model, expected, name, part)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config implies {want}")
        if part:
            parts.setdefault(name, {})[part] = tensor
        else:
            state[name] = tensor
    state.update(fuse_parts(parts))
    if model.cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state) - elsewhere)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:4])}")
    if model.cfg.family == "gemma3":
        state = gemma_norms(state)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if model.cfg.tie_word_embeddings and "embed_tokens.weight" not in elsewhere:
        model.lm_head.weight = model.embed_tokens.weight


def rope_buffers(model: DecoderModel) -> None:
    """The RoPE buffers of a model built on the meta device, made for real."""
    if model.cfg.family != "opt":
        from ..decoder import rope_inv_freq
        model.inv_freq = rope_inv_freq(model.cfg)
        if model.inv_freq_local is not None:
            model.inv_freq_local = rope_inv_freq(model.cfg, local=True)


def gemma_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma's RMSNorms scale by ``1 + w`` (``w`` is what its checkpoints store): the model's norms
    get ``1 + w``, computed in float32 as transformers computes it on every call."""
    return {k: (1.0 + v.float()) if k.endswith("norm.weight") else v for k, v in state.items()}


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               allow_pickle: bool = False, quantize: str = "none", gguf: str | Path | None = None) -> DecoderModel:
    """Load a Hugging Face model folder as a ``DecoderModel`` in eval mode.

    ``quantize`` (see :data:`hispec.config.QUANTIZE`): ``native`` puts the 4-bit tensors of ``gguf`` (the file
    the folder was converted from) on the int4 kernel, ``int4`` / ``int8`` quantize the decoder's
    float weights, ``auto`` is ``native`` where the file has 4-bit tensors and the kernels pay on
    this CPU (``kernels/select.py``), else ``none``.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    try:
        cfg = read_config(path)
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    with torch.device("meta"):
        model = DecoderModel(cfg)
    load_weights(model, _weight_files(path, allow_pickle), dtype)
    rope_buffers(model)
    model = model.to(device).eval().requires_grad_(False)
    apply_quantization(model, quantize, gguf)
    if model.device.type == "cpu":
        hugepages.gather(model)  # the weights a decode step streams, in 2 MiB pages: same values
    return model


# native GGUF weights also keep a dense bfloat16 copy for prompt prefill (QuantLinear.dense: +2 bytes
# per decoder weight): on the int4 kernel always; on q4, and q8a without integer dot products, where
# the CPU has bfloat16 hardware (there the dense bfloat16 product of a prompt chunk ran 1.7-1.8x
# faster than q4's float32 panels: 64 and 256 rows, the 120 decoder matmuls, Zen 4; without it the
# panels win). q8a with integer dot products prefills on its own rows, faster still (quant.
# q8a_prefills_on_rows): no copy. HISPEC_PREFILL_DENSE=0 prefills on the 4-bit kernel's own path.


def apply_quantization(model: DecoderModel, quantize: str, gguf: str | Path | None = None) -> str:
    """Put the decoder's linear layers on the quantized kernels as ``quantize`` asks; returns the
    format chosen (``model.weight_format``).

    ``native``: every decoder linear whose GGUF tensors map onto one of the block kernels' forms
    (``gguf_weights``: Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0) runs on the file's blocks, and so does the
    output head where its type maps; the other linears (and a head in another type than F32) are
    requantized to the 8-bit form from their float values (row-invariant kernels, error <= amax / 254
    per weight), and only those whose rows are not a multiple of 16 keep their float32 copy: one
    warning says which (their types, how many, the error bound, the float32 size). A file with
    nothing that runs natively is refused, naming what does. ``auto``: ``native`` where the file has a tensor of such a type and the kernels pay on
    this CPU (else, or where none of its layers maps after all, ``none``)."""
    from ...kernels.quant import quantize_linears

    asked, quantize = quantize, choose_quantize(quantize, gguf, model.device.type)
    parts = native_parts(gguf, model.cfg, refuse=asked == "native") if quantize == "native" else None
    if parts is not None:  # the embedding keeps its float32 copy of the head's values for lookups
        put_native(model, *parts, lambda name, old: getattr(old, "weight", None))
    elif quantize in ("int4", "int8"):
        quantize_linears(model.layers, quantize)
    quantize = "none" if quantize == "native" and parts is None else quantize
    set_act_dtypes(model)
    model.weight_format = quantize
    return quantize


def choose_quantize(quantize: str, gguf: str | Path | None, device_type: str = "cpu") -> str:
    """What ``quantize`` comes to for a model from ``gguf`` (None: not a GGUF file) on ``device_type``:
    ``auto`` is ``native`` where the file has a tensor of a type with a block form and the kernels pay
    on this CPU, else ``none``; ConfigError where the kernels cannot run as asked."""
    from ...kernels.select import quantized_kernels_pay

    check_engine_options({"quantize": quantize})
    on_cpu = device_type == "cpu"
    if quantize == "auto":
        pays = on_cpu and gguf is not None and quantized_kernels_pay()[0]
        return "native" if pays and _has_native_tensor(gguf) else "none"
    if quantize != "none" and not on_cpu:
        raise ConfigError(f"--quantize {quantize}: the int4/int8 kernels are CPU kernels; use --quantize none on "
                          f"{device_type}")
    if quantize == "native" and gguf is None:
        raise ConfigError("--quantize native needs a GGUF model (the default model or a .gguf file)")
    return quantize


def native_parts(gguf: str | Path, cfg: ModelConfig, refuse: bool) -> tuple[dict, object] | None:
    """The block-kernel layers of ``gguf``'s decoder linears by module name and its output head (or
    None), ``gguf_weights``' (one warning line names what was requantized or stays float32); None
    where nothing runs natively and not ``refuse``, else a ConfigError naming what does."""
    import logging

    from .gguf_weights import SUPPORTED, decoder_types, float_layers, float_message, native_head, native_linears

    # only llama.cpp's ``llama`` architecture stores Q and K rows permuted (qwen2, qwen3, gemma3 do not)
    head = native_head(gguf)  # first: its transients (the largest tensor's) come before the layers
    linears, _ = native_linears(gguf, cfg.num_heads, cfg.num_kv_heads, permuted=cfg.family == "llama")
    floats = float_layers(gguf, linears)
    if not linears and head is None:
        if not refuse:
            return None
        found = ", ".join(f"{name} is {k}" for k, name in decoder_types(gguf).items()) or "no decoder linears"
        why = "; ".join(sorted({f.why for f in floats}))
        raise ConfigError(f"{Path(gguf).name} has no tensors that run natively ({found}{': ' if why else ''}"
                          f"{why}); the native kernels run {SUPPORTED}; --quantize none runs its float32 copy")
    if (said := float_message(Path(gguf).name, floats, linears, head)) is not None:
        logging.getLogger(__name__).warning(said)
    return linears, head


def set_act_dtypes(model: DecoderModel) -> None:
    """Layers on the int4/int8 kernels take (and give) bfloat16 between them."""
    from ...kernels.quant import act_dtype_of

    for layer in model.layers:
        if (act := act_dtype_of(layer)) is not None:
            layer.act_dtype = act


def put_native(model: DecoderModel, linears: dict, head, float_weight) -> None:
    """Put the block-kernel layers ``linears`` (by module name, ``gguf_weights.native_linears``) and
    the output ``head`` (or None) in the model's place. A layer keeps the bias of the module it
    replaces (e.g. qwen2's q/k/v biases: added after the kernel) and, where its kernel prefills on
    a dense copy, ``float_weight(name, replaced module)``'s values ``[N, K]`` in bfloat16 (see below)."""
    from ...kernels.quant import ACT_DTYPE, Q4_STORAGE, q8a_prefills_on_rows
    from ...kernels.select import cpu_has_bf16

    for name, layer in linears.items():
        parent, child = name.rsplit(".", 1)
        old = getattr(model.get_submodule(parent), child)
        own_rows = layer.kernel == "q8a" and q8a_prefills_on_rows()
        if envs.HISPEC_PREFILL_DENSE and not own_rows \
                and (layer.input_dtype == ACT_DTYPE or layer.kernel in Q4_STORAGE and cpu_has_bf16()):
            weight = float_weight(name, old)
            if weight is not None and weight.shape == (layer.out_features, layer.in_features):
                layer.dense = weight.detach().to(torch.bfloat16).contiguous()
        if getattr(old, "bias", None) is not None:
            layer.bias = old.bias.detach()
        setattr(model.get_submodule(parent), child, layer)
    if head is not None:
        model.lm_head = head


def _has_native_tensor(gguf: str | Path) -> bool:
    """Whether the GGUF file has a tensor of a type with a native block form (``gguf_weights``)."""
    from .gguf_weights import NATIVE_TYPES, gguf_tensors

    return any(t.tensor_type.name in NATIVE_TYPES for t in gguf_tensors(gguf))
