"""Messages about names a load asks for and a checkpoint holds, with the hint that fits. Pure.

An *optimizer name* is a dotted state-dict name that belongs to an optimizer's state dict as
torch builds it (``optimizer.state_dict()`` or
``torch.distributed.checkpoint.state_dict.get_state_dict``): one with a ``param_groups``
component, or with a ``state`` component and a last component that torch's optimizers keep per
parameter (``exp_avg``, ``momentum_buffer``, ``step``...). The optimizer hints are given only
when such names are involved.
"""

from __future__ import annotations

from collections.abc import Sequence

from cloudckpt.wording import plural

#: Per-parameter state keys of torch.optim's optimizers.
OPTIMIZER_STATE_KEYS = frozenset(
    {
        "step",
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "sum",
        "grad_avg",
        "mu",
        "eta",
        "ax",
        "prev",
        "step_size",
        "exp_inf",
        "mu_product",
        "state_sum",
    }
)
_SHOWN = 8


def is_optimizer_name(name: str) -> bool:
    """Whether ``name`` looks like part of an optimizer's state dict (module docstring)."""
    parts = name.split(".")
    if "param_groups" in parts:
        return True
    return "state" in parts[:-1] and parts[-1] in OPTIMIZER_STATE_KEYS


def _shown(names: Sequence[str]) -> str:
    text = ", ".join(map(repr, names[:_SHOWN]))
    return text + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def missing_names_message(missing: Sequence[str]) -> str:
    """The message of a strict load that asks for names the checkpoint lacks."""
    are = "is" if len(missing) == 1 else "are"
    text = f"{plural(len(missing), 'name')} {are} not in the checkpoint: {_shown(missing)}"
    optimizer = [n for n in missing if is_optimizer_name(n)]
    if optimizer:
        return (
            f"{text} ({plural(len(optimizer), 'optimizer entry', 'optimizer entries')}: a "
            "checkpoint saved without the optimizer, or before its first step, has none; "
            "load with strict=False to keep the optimizer's current state)"
        )
    return (
        f"{text} (were they saved under other names, with another prefix? load with "
        "strict=False to fill only what the checkpoint holds)"
    )


def unexpected_names_message(unexpected: Sequence[str]) -> str:
    """The warning of a load that leaves stored names unrequested. The fresh-optimizer hint is
    given when optimizer state is among them but its ``param_groups`` were requested (the state
    dict holds an optimizer with no state yet)."""
    were = "was" if len(unexpected) == 1 else "were"
    stay = "stays" if len(unexpected) == 1 else "stay"
    text = (
        f"{plural(len(unexpected), 'stored name')} {were} not requested and {stay} "
        f"unloaded: {_shown(unexpected)}"
    )
    state = [n for n in unexpected if is_optimizer_name(n)]
    groups = [n for n in unexpected if "param_groups" in n.split(".")]
    if state and not groups:
        text += (
            " (the state dict's optimizer has no state to fill yet, as a fresh one: build "
            "the state dict with torch.distributed.checkpoint.state_dict.get_state_dict "
            "(model, optimizer), which creates it, then set_state_dict after the load)"
        )
    return text
