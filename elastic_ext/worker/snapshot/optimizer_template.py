"""An optimizer's state to load into, made from a checkpoint's metadata in a moment.

DCP loads into tensors that exist: torch's ``get_optimizer_state_dict`` creates them
for a fresh optimizer by taking one optimizer step on zero gradients (``state_dict.
_init_optim_state``), and ``set_optimizer_state_dict`` takes it again; on a new worker,
with DTensor's dispatch caches cold, that was most of a sharded restore (0.1-0.4 s
on this machine). Here the tensors are allocated instead: a state of a parameter's
global shape gets the parameter's own sharding (Adam's moments, momentum buffers), a
0-d state a plain scalar (``step``), and the loaded state goes to the optimizer through
its own ``load_state_dict``, keyed as ``Optimizer.state_dict`` keys it. Anything else
(a state of another shape) returns None, and the caller takes torch's way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor


def state_template(model: torch.nn.Module, optimizer: torch.optim.Optimizer, name: str,
                   metadata: Metadata) -> dict[str, Any] | None:
    """``{"state": {param fqn: {state name: tensor}}}`` for the states ``metadata`` holds
    under ``name`` (DCP's flattened ``<name>.state.<fqn>.<state>`` keys), or None when a
    state's shape is neither its parameter's nor a scalar's, or the optimizer's parameters
    are not all the model's."""
    params = {id(p): fqn for fqn, p in model.named_parameters()}
    by_fqn = {fqn: p for fqn, p in model.named_parameters()}
    wanted = {params.get(id(p)) for group in optimizer.param_groups for p in group["params"]}
    if None in wanted:
        return None
    prefix = f"{name}.state."
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, _, state_name = key[len(prefix):].rpartition(".")
        param = by_fqn.get(fqn)
        if param is None or not isinstance(md, TensorStorageMetadata):
            return None
        dtype = md.properties.dtype
        if tuple(md.size) == tuple(param.shape) and isinstance(param, DTensor):
            local = torch.empty_like(param.to_local(), dtype=dtype)
            value: torch.Tensor = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride())
        elif len(md.size) == 0:
            value = torch.zeros((), dtype=dtype)
        else:
            return None
        state.setdefault(fqn, {})[state_name] = value
    return {"state": state}


def load_into(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
              loaded: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Give ``optimizer`` the ``loaded["state"]`` (by parameter name) and ``param_groups``
    (by parameter name, as ``get_optimizer_state_dict`` writes them) through its own
    ``load_state_dict``: parameters numbered in group order, as it numbers them."""
    index: dict[str, int] = {}
    groups = []
    for group in param_groups:
        ids = []
        for fqn in group["params"]:
            ids.append(index.setdefault(fqn, len(index)))
        groups.append({**group, "params": ids})
    state = {index[fqn]: dict(values) for fqn, values in loaded["state"].items()
             if fqn in index}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


__all__ = ["load_into", "state_template"]
