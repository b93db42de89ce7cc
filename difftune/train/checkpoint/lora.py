"""The LoRA files a run writes (every N steps and at the end), and what they are made of.

LoRA files are written atomically (temporary file, then rename) in the configured key layout,
with safetensors metadata saying what they are. `LoraFiles` also names the trained parameters
canonically (`trainable()`), which the checkpoint manager built on it saves and restores.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from difftune import __version__
from difftune.adapters import coverage
from difftune.adapters.dora_comfyui import (COMFYUI, PEFT, comfyui_path, comfyui_tensors,
                                            formula_keys)
from difftune.adapters.embeddings import Embeddings
from difftune.adapters.formats import fold_scale, merged_adapter_metadata, save_lora, with_clip_root
from difftune.adapters.full import named_full
from difftune.adapters.full_files import save_folder
from difftune.adapters.kinds import is_adapter_parameter, uses_lycoris_layout
from difftune.adapters.lora import lora_state
from difftune.adapters.lycoris_files import FULL_PRECISION, adapted_layers, to_file
from difftune.adapters.metadata import FileFacts, embedding_keys, lora_keys, lycoris_keys
from difftune.config import RunConfig, SaveConfig
from difftune.files.single import Piece, write_layout
from difftune.files.space import check_free, writing
from difftune.families.base import Components, Family
from difftune.families.common.experts import Experts
from difftune.families.common.text import file_clip_roots
from difftune.files.names import embedding_stem
from difftune.precision.policy import DTYPES
from difftune.train.experts import trained
from difftune.train.sharding import full_state

log = logging.getLogger("difftune")


def lora_format(save: SaveConfig, family: Family) -> str:
    """The key layout LoRA files are written in: save.format, or else the family's default
    (the layout ComfyUI and diffusers both read completely for that family)."""
    return save.format or family.default_format


class LoraFiles:
    """Writes the LoRA (every N steps and at the end) and the resolved config.

    With `writes` False (every process but rank 0 of a multi-process run, whose trained
    weights are the same) the save methods return the paths rank 0 writes and write nothing.
    """

    def __init__(self, cfg: RunConfig, family: Family, comps: Components, targets: list[str],
                 dataset_summary: dict[str, Any], embeddings: Embeddings | None = None,
                 writes: bool = True) -> None:
        self.cfg, self.family, self.comps = cfg, family, comps
        self.writes = writes
        self.embeddings = embeddings
        self.out: Path = cfg.save.dir
        self.base_name, self.targets = comps.name, targets
        self.dataset_summary = dataset_summary
        # The adapter files the last save wrote (two for a model of two experts).
        self.written: list[Path] = []
        # Resolved once, so the files, config.resolved.json and checkpoints all say the same.
        # LyCORIS kinds have one layout, and save.format stays unset (it is refused with them).
        self.lycoris = uses_lycoris_layout(cfg.adapter.type, cfg.adapter.dora)
        if not self.lycoris:
            cfg.save.format = lora_format(cfg.save, family)
        fmt = coverage.LYCORIS if self.lycoris else str(cfg.save.format)
        adapters = writes and cfg.adapter.peft_kind is not None
        gaps = coverage.describe(family, fmt, targets) if adapters else ""
        if gaps:
            log.warning("the LoRA files of this run: %s", gaps)

    def write_config(self) -> Path:
        """The resolved config as JSON (every default filled in)."""
        path = self.out / "config.resolved.json"
        if not self.writes:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.cfg.model_dump(mode="json"), indent=2), encoding="utf-8")
        return path

    def lora_path(self, step: int, final: bool) -> Path:
        """`<name>.safetensors` at the end, `<name>-step000123.safetensors` before."""
        name = self.cfg.save.name
        return self.out / (f"{name}.safetensors" if final else f"{name}-step{step:06d}.safetensors")

    def metadata(self, step: int, alpha: float) -> dict[str, str]:
        """What the file is: family, base, rank, targets, steps, data, version, and the keys
        other tools read. `alpha` is the one the file's tensors are read with (the rank when
        the scale was folded into them); `difftune.trained_alpha` is adapter.alpha."""
        a = self.cfg.adapter
        facts = FileFacts(self.cfg.save.name, self.resolution, step, self.cfg.train.steps)
        return {
            "difftune.version": __version__,
            "difftune.family": self.family.name,
            "difftune.base_model": self.base_name,
            "difftune.format": "lycoris" if self.lycoris else str(self.cfg.save.format),
            "difftune.rank": str(a.rank),
            "difftune.alpha": str(float(alpha)),
            "difftune.trained_alpha": str(float(a.scale_alpha)),
            "difftune.targets": json.dumps(self.targets),
            "difftune.text_encoders": json.dumps(a.text_encoders),
            "difftune.steps": str(step),
            "difftune.dataset": json.dumps(self.dataset_summary),
        } | lora_keys(self.family.model_spec(self.comps), facts, a.rank, alpha)

    @property
    def resolution(self) -> int:
        """The training resolution written into the files (the largest of any dataset)."""
        return max(r for d in self.cfg.datasets for r in d.resolutions)

    def save_lora(self, step: int, final: bool = False, path: Path | None = None) -> Path:
        """Export the trained LoRA (denoiser and text encoders) in the configured format (with
        the embeddings bundled, and also as embedding files); returns the file (the first
        embedding file when only embeddings train)."""
        if self.cfg.adapter.type == "full" and self.cfg.train.distributed == "fsdp":
            return self.save_full(step, final, path)  # every process: the gather is collective
        if not self.writes:
            return path or self.lora_path(step, final)
        files = self.save_embeddings(step, final, path)
        if self.cfg.adapter.type == "embedding":
            return files[0]
        if self.cfg.adapter.type == "full":
            return self.save_full(step, final, path)
        target = path or self.lora_path(step, final)
        if not isinstance(self.comps.denoiser, Experts):
            self.written = [self._save_adapter(step, target, self.modules())]
            return self.written[0]
        stem = target.name.removesuffix(".safetensors")
        self.written = [self._save_adapter(step, target.with_name(f"{stem}{e.suffix}.safetensors"),
                                           self.modules(), e.part, {"difftune.expert": e.name})
                        for e in trained(self.cfg, self.family.spec)]
        return self.written[0]

    def _save_adapter(self, step: int, path: Path, modules: dict[str, torch.nn.Module],
                      part: str | None = None, extra: dict[str, str] | None = None) -> Path:
        """One adapter file of `modules` at `path` in the configured layout; with `part`,
        only that expert's LoRA of a two-expert model (`<name>_high_noise`,
        `<name>_low_noise`: each a whole LoRA of one transformer, as ComfyUI's model
        branches and WanPipeline's `transformer` / `transformer_2` load it)."""
        a, fmt = self.cfg.adapter, str(self.cfg.save.format)
        if self.lycoris:  # refused with two experts at config load
            return self._save_lycoris(step, path, modules)
        state = {k: v for prefix, m in modules.items() for k, v in lora_state(m, prefix).items()}
        if part is not None:
            state = _expert_state(state, self.family.denoiser_prefix, part)
        # CLIP modules as every reader maps them (`text_encoder.text_model.encoder...`).
        state = with_clip_root(state, file_clip_roots(self.family))
        alpha, meta = a.scale_alpha, {}
        if fmt in ("diffusers", "original"):
            # ComfyUI takes no alpha from a diffusers-layout file (neither metadata nor tensor),
            # diffusers' original-layout converter refuses alpha keys: the scale goes into the
            # up factors, and the file says alpha = rank everywhere.
            state, alpha = fold_scale(state, a.scale_alpha / a.rank), float(a.rank)
        if fmt == "diffusers":
            meta = merged_adapter_metadata(state, a.rank, alpha, list(modules))
        meta |= self.metadata(step, alpha) | (extra or {})
        tensors = self.family.lora_to_format(self.comps, state, fmt, a.rank, alpha)
        return self._write_file(tensors, meta, path)

    def _save_lycoris(self, step: int, path: Path, modules: dict[str, torch.nn.Module]) -> Path:
        """Write a LoCon/LoHa/LoKr/DoRA adapter in the LyCORIS layout (`lycoris_files`)."""
        layers = adapted_layers(self.family, modules, file_clip_roots(self.family))
        tensors = to_file(layers)
        meta = self.metadata(step, self.cfg.adapter.scale_alpha) | lycoris_keys(self.cfg.adapter)
        if not self.cfg.adapter.dora:
            return self._write_file(tensors, meta, path)
        written = self._write_file(tensors, meta | formula_keys(PEFT), path)
        if self.cfg.save.dora_comfyui:  # the same adapter for ComfyUI's DoRA formula
            self._write_file(comfyui_tensors(layers, tensors), meta | formula_keys(COMFYUI),
                             comfyui_path(path))
        return written

    def _write_file(self, tensors: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> Path:
        """The file with the bundled embeddings, atomically, in save.dtype (DoRA magnitudes
        in float32)."""
        if self.embeddings is not None:  # pivotal tuning: the placeholders travel with the LoRA
            tensors.update({f"{BUNDLE}{name}.{key}": value for name, vectors in
                            self.embeddings.file_tensors().items() for key, value in vectors.items()})
        with writing(path.parent, f"LoRA {path.name}", self.bytes_needed(), FIX):
            path = save_lora(path, tensors, meta, DTYPES[self.cfg.save.dtype], FULL_PRECISION)
        log.info("saved LoRA %s", path)
        return path

    def save_full(self, step: int, final: bool, path: Path | None = None) -> Path:
        """A full fine-tune's trained models as diffusers folders in save.dtype, under
        `<name>/` (`<name>-step000123/` before the end), each in its pipeline subfolder, and
        the denoiser as the family's single file beside it (`<name>.safetensors`, where the
        family declares one); returns the folder."""
        file = path or self.lora_path(step, final)
        folder = file.with_name(file.name.removesuffix(".safetensors"))
        dtype = DTYPES[self.cfg.save.dtype]
        # FSDP: every process joins the gather of the whole weights into rank 0's host memory.
        states = {prefix: full_state(module) for prefix, module in self.modules().items()}
        if not self.writes:
            return folder
        with writing(folder.parent, f"model {folder.name}", self.bytes_needed(), FIX):
            for prefix, module in self.modules().items():
                save_folder(module, folder / prefix, dtype, state=states[prefix])
            layout = self.family.single_file_layout(self.comps)
            if layout is not None:
                meta = {"format": "pt", "difftune.version": __version__,
                        "difftune.family": self.family.name, "difftune.base_model": self.base_name,
                        "difftune.steps": str(step)}
                # the frozen tensors the file also holds (Anima's LLM adapter), as they are
                extras = self.family.single_file_extras(self.comps)
                layout = {**layout, **{name: Piece((name,)) for name in extras}}
                write_layout(file, layout, {**states[self.family.denoiser_prefix], **extras},
                             dtype, meta)
        log.info("saved the fine-tuned model %s%s", folder,
                 f" and {file.name}" if layout is not None else "")
        return folder

    def save_embeddings(self, step: int, final: bool, folder_of: Path | None) -> list[Path]:
        """One file per placeholder (`<placeholder>.safetensors`, tensors named by encoder as
        ComfyUI / A1111 read them) in `embeddings/`, or beside `folder_of`; [] without any."""
        if self.embeddings is None:
            return []
        folder = folder_of.parent if folder_of is not None else self.out / "embeddings"
        folder.mkdir(parents=True, exist_ok=True)
        suffix = "" if final or folder_of is not None else f"-step{step:06d}"
        paths = []
        for name, vectors in self.embeddings.file_tensors().items():
            stem = embedding_stem(name)
            meta = {"difftune.placeholder": name, "difftune.family": self.family.name,
                    "difftune.steps": str(step)} | embedding_keys(
                        self.family.model_spec(self.comps), name, self.resolution)
            with writing(folder, f"embedding {stem}", self.bytes_needed(), FIX):
                paths.append(save_lora(folder / f"{stem}{suffix}.safetensors", vectors, meta,
                                       torch.float32))
        return paths

    def modules(self) -> dict[str, torch.nn.Module]:
        """Every module that carries a trained LoRA, by its LoRA key prefix."""
        trains = self.cfg.adapter.peft_kind is not None or self.cfg.adapter.type == "full"
        out = {self.family.denoiser_prefix: self.comps.denoiser} if trains else {}
        for name in self.cfg.adapter.text_encoders:
            out[self.family.text_encoder_prefixes[name]] = self.comps.text_encoders[name]
        return out

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        """The trained parameters by canonical name: the diffusers LoRA key, which depends on
        neither peft's adapter naming nor how the base layer is stored or quantized (a full
        fine-tune's: `<prefix>.<parameter name>`)."""
        if self.cfg.adapter.type == "full":
            return {k: p for prefix, m in self.modules().items()
                    for k, p in named_full(m, prefix).items()}
        out = {f"{prefix}.{_ADAPTER.sub('', n)}": p for prefix, module in self.modules().items()
               for n, p in module.named_parameters() if is_adapter_parameter(n)}
        return out | (self.embeddings.parameters() if self.embeddings is not None else {})

    def bytes_needed(self) -> int:
        """About what one save takes: a checkpoint (fp32 weights, two optimizer moments, the
        LoRA) and the LoRA file beside it, with a DoRA run's ComfyUI file in both (a full
        fine-tune: its models, folder and file)."""
        n = sum(p.numel() for p in self.trainable().values())
        size = DTYPES[self.cfg.save.dtype].itemsize
        ema = 4 * n if self.cfg.train.ema.enabled else 0
        if self.cfg.adapter.type == "full":  # the whole models: a folder and a single file
            total = sum(p.numel() for m in self.modules().values() for p in m.parameters())
            return n * (4 + 8) + ema + total * 2 * size + (64 << 10)
        files = 4 if self.cfg.adapter.dora and self.cfg.save.dora_comfyui else 2  # + ComfyUI's
        return n * (4 + 8 + files * size) + ema + (64 << 10)

    def check_space(self) -> None:
        """Refuse to start when save.dir has no room for one save."""
        if self.writes:
            check_free(self.out, "checkpoints and the LoRA", self.bytes_needed(), FIX)


def _expert_state(state: dict[str, torch.Tensor], prefix: str, part: str
                  ) -> dict[str, torch.Tensor]:
    """One expert's LoRA out of a two-expert model's (`<prefix>.<part>.<module>...` keys), named
    as a LoRA of that transformer alone (`<prefix>.<module>...`)."""
    head = f"{prefix}.{part}."
    return {f"{prefix}.{k[len(head):]}": v for k, v in state.items() if k.startswith(head)}


FIX = "free space there, or set save.dir to a folder with room"
BUNDLE = "bundle_emb."  # pivotal tuning: embeddings inside the LoRA file, as kohya names them
_ADAPTER = re.compile(r"\.default(?=\.weight$|$)")
