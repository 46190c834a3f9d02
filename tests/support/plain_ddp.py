"""A training script that knows nothing of elastic-ext, for ``tests/test_warm_lifecycle.py``.

The shape of PyTorch's multinode DDP tutorial (``distributed/ddp-tutorial-series/
multinode.py`` in pytorch/examples): ``ddp_setup`` from torchrun's environment, a
``Trainer`` class that wraps the model in DDP, a ``DataLoader`` with a
``DistributedSampler`` over a toy dataset, and a snapshot of the model and the epoch
(``snapshot.pt`` in the working directory) that a restarted worker resumes from.
It runs on CPUs with three changes, each marked ``CPU:`` below: the model goes to the
CPU instead of ``LOCAL_RANK``'s GPU, DDP gets ``device_ids=None``, and each batch goes
to the CPU. Nothing in it imports elastic-ext or handles a peer's death.
"""

import os

import torch
import torch.distributed
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    rank = int(os.environ["LOCAL_RANK"])
    if torch.accelerator.is_available():
        device_type = torch.accelerator.current_accelerator()
        device = torch.device(f"{device_type}:{rank}")
        torch.accelerator.set_device_index(rank)
        print(f"Running on rank {rank} on device {device}")
        init_process_group(backend=torch.distributed.get_default_backend_for_device(device))
        return device_type
    device = torch.device("cpu")
    print(f"Running on device {device}")
    init_process_group(backend="gloo")
    return device


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model.to("cpu")  # CPU: was model.to(self.local_rank)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.device = device
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=None)  # CPU: was device_ids=[self.local_rank]

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=str(self.device))
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to("cpu")  # CPU: was source.to(self.local_rank), the same for targets
            targets = targets.to("cpu")
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    device = ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, device)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
