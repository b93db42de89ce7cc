"""Checks of the options of a model of two experts (`train.experts`,
`train.expert_switch_every`, `train.expert_boundary`), run at config load.

Which experts a model has is its family spec's (`FamilySpec.experts`, Wan 2.2 A14B's high- and
low-noise ones); a run of any other model that sets them is refused, as is what the two-expert
run does not do yet, naming the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from difftune.families import registry

if TYPE_CHECKING:
    from difftune.config.run import RunConfig

SET = ("experts", "expert_boundary")


def expert_problems(cfg: "RunConfig") -> list[str]:
    """What is wrong with the expert options for this model."""
    t, m = cfg.train, cfg.model
    spec = registry.spec(m.family, m.variant)
    names = [e.name for e in spec.experts]
    if not names:
        given = [f"train.{k}" for k in SET if getattr(t, k) is not None]
        model = f'model.family = "{m.family}"' + (f' (variant "{m.variant}")' if m.variant
                                                    else "")
        return [f"{k}: {model} has one denoiser, no experts to choose; remove it"
                for k in given]
    problems = []
    chosen = t.experts if t.experts is not None else names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        problems.append(f"train.experts: {', '.join(repr(n) for n in unknown)} is no expert "
                        f"of {m.variant}; its experts are {', '.join(repr(n) for n in names)}")
    elif not chosen or len(set(chosen)) != len(chosen):
        problems.append(f"train.experts = {chosen}: name each expert to train once (of "
                        f"{', '.join(repr(n) for n in names)})")
    if cfg.adapter.type == "full":
        problems.append(f'adapter.type = "full" with {m.variant}: a full fine-tune of two '
                        "14B experts is not supported; train LoRAs (one per expert), or train "
                        "one expert alone with model.variant = \"2.2-t2v-a14b-low\"")
    if t.blocks_to_swap:
        problems.append(f"train.blocks_to_swap with {m.variant}: block swap over two experts "
                        "is not supported yet (the idle expert waits in host memory, the "
                        "active one is on the GPU whole); set blocks_to_swap = 0 and fit the "
                        "expert with precision.quantize.denoiser = \"int8\" (or fp8 storage), "
                        "fewer frames or a lower resolution (check says what fits)")
    if cfg.adapter.type in ("locon", "loha", "lokr") or cfg.adapter.dora:
        kind = "adapter.dora" if cfg.adapter.dora else f'adapter.type = "{cfg.adapter.type}"'
        problems.append(f"{kind} with {m.variant}: the LyCORIS layout is not written per "
                        "expert yet; train adapter.type = \"lora\"")
    return problems


def file_suffixes(resolved: dict[str, Any]) -> tuple[str, ...]:
    """What ends the stems of the files one save of a run writes, read from its resolved
    config (a dict: the web app and `runs rank` read run folders): a two-expert model's
    trained experts' suffixes in the spec's order (`_high_noise`, `_low_noise`), or ("",) for
    one denoiser (or a model unknown here)."""
    from difftune.errors import ConfigError

    model = resolved.get("model", {})
    try:
        experts = registry.spec(str(model.get("family")), model.get("variant")).experts
    except (KeyError, ValueError, ConfigError):
        return ("",)
    trained = resolved.get("train", {}).get("experts") or [e.name for e in experts]
    return tuple(e.suffix for e in experts if e.name in trained) or ("",)


def file_suffix(resolved: dict[str, Any]) -> str:
    """What ends the stem of a run's first LoRA file (`file_suffixes`' first): a two-expert
    model's first trained expert's suffix (`_high_noise`), or "" for one denoiser."""
    return file_suffixes(resolved)[0]
