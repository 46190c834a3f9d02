"""The optimizer state a sharded restore loads into, made without an optimizer step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from elastic_ext.worker.snapshot.memory_storage import MemoryReader, MemoryWriter
    from elastic_ext.worker.snapshot.optimizer_template import load_into, state_template
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,))

    class Odd(torch.optim.SGD):  # a state of another shape than its parameter's
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["counts"] = torch.zeros(3)

    def build(opt_class):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, opt_class(model.parameters(), lr=0.1)

    for opt_class in (torch.optim.AdamW, Odd):
        model, opt = build(opt_class)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        saved = get_optimizer_state_dict(model, opt)
        writer = MemoryWriter()
        meta = dcp.save({"optimizer": saved}, storage_writer=writer, no_dist=True)
        fresh, fresh_opt = build(opt_class)
        template = state_template(fresh, fresh_opt, "optimizer", meta)
        print(opt_class.__name__, "template", template is not None, "state before",
              len(fresh_opt.state))
        if template is None:
            continue
        dcp.load({"optimizer": template}, storage_reader=MemoryReader(meta, writer.chunks),
                 no_dist=True)
        load_into(fresh_opt, fresh, template, saved["param_groups"])
        ok = all(torch.equal(getattr(a, "to_local", lambda: a)(),
                             getattr(b, "to_local", lambda: b)())
                 for (pa, sa), (pb, sb) in zip(opt.state.items(), fresh_opt.state.items())
                 for a, b in zip(sa.values(), sb.values()))
        print(opt_class.__name__, "equal", ok, len(fresh_opt.state))
""")


def test_adamws_state_is_made_from_the_metadata_and_loads_bit_exact_else_none() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "AdamW template True state before 0" in lines, done.stdout
    assert "AdamW equal True 4" in lines, done.stdout
    # a state of another shape than its parameter's: the caller takes torch's own way
    assert "Odd template False state before 0" in lines, done.stdout
