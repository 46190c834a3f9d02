"""A lone process (no launcher) training on ``ElasticLoop``: what a test asks of it.

argv: a JSON object ``{"dir": DIR, "steps": N, "dataset": D, "raise_at": step | null,
"split_update": bool, "fault_in_update_at": step | null}``. Prints one JSON line per step
(``{"step": s, "ids": [...]}``) and the loop's events go to ``DIR/metrics.jsonl``;
``raise_at`` raises a plain error at that step (not a peer's fault), which must end the
process with its traceback as usual. ``split_update`` updates between ``begin_update``
and ``end_update`` (as a framework's callbacks do, the first one twice as for an
optimizer that calls its closure several times); ``fault_in_update_at`` has the guard
keep the state between the two at that step, as a peer's fault there would, then exits.
``resume_other_runs`` sets the loop's setting of that name.
``surface`` prints the public names of the loop and of its ``framework`` and exits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from elastic_ext import ElasticLoop, LoopSettings


def public(obj: object) -> list[str]:
    """The names a user of ``obj`` sees: its class's and its own, less the underscored."""
    return sorted(name for name in dir(obj) if not name.startswith("_"))


def main() -> None:
    spec = json.loads(sys.argv[1])
    directory = Path(spec["dir"])
    loop = ElasticLoop(LoopSettings(snapshot_dir=directory / "snapshots", snapshot_every=3,
                                    events_file=directory / "metrics.jsonl",
                                    resume_other_runs=spec.get("resume_other_runs", False)))
    if spec.get("surface"):
        print(json.dumps({"loop": public(loop), "framework": public(loop.framework)}))
        loop.framework.close()
        return
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loop.restore(model=model, optimizer=optimizer)
    for ids in loop.batches(spec["dataset"], 4, seed=1, steps=spec["steps"]):
        loss = model(torch.ones(len(ids), 3) * ids.unsqueeze(1)).pow(2).mean()
        loss.backward()
        if spec.get("split_update"):
            loop.framework.begin_update()
            loop.framework.begin_update()  # again, as LBFGS calls the closure and hook twice
            optimizer.step()
            optimizer.zero_grad()
            if loop.step + 1 == spec.get("fault_in_update_at"):
                # What the guard calls on a peer's fault (the guard is the loop's own).
                assert loop._guard.keep_state is not None
                loop._guard.keep_state("a collective failed")  # must not wait for itself
                print(json.dumps({"kept_at": loop.framework.held_step}), flush=True)
                loop.framework.close()
                return
            loop.framework.end_update()
        else:
            with loop.update():
                optimizer.step()
                optimizer.zero_grad()
        if loop.step + 1 == spec.get("raise_at"):
            raise RuntimeError("a bug in the training code")
        loop.step_done(loss)
        print(json.dumps({"step": loop.step, "ids": ids.tolist()}), flush=True)
    loop.finish(note="finished")


if __name__ == "__main__":
    main()
