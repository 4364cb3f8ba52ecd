# SPDX-License-Identifier: Apache-2.0
"""Synthetic training benchmark with Horovod's flags and output: img/sec per rank and in total.

    shmcommrun -np 2 python examples/torch_synthetic_benchmark.py --model resnet18 --image-size 64

The model is a ResNet built here from torch.nn (no torchvision needed); the data is random. --backend picks how
gradients travel: shmcomm's DistributedOptimizer (default); DistributedDataParallel over gloo, with shmcomm's
communication hook, or on torch.distributed's "shmcomm" backend; or FSDP2 (fully_shard, one shard per top-level block)
over gloo or the "shmcomm" backend. Under shmcommrun every rank is one CPU process."""
import argparse
import os
import tempfile
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import shmcomm.torch as hvd


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """He et al.'s ResNet with basic blocks; `blocks` per stage, widths 64-128-256-512 scaled by `width`."""

    def __init__(self, blocks, width=1.0, classes=1000):
        super().__init__()
        widths = [max(8, int(w * width)) for w in (64, 128, 256, 512)]
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for stage, (n, cout) in enumerate(zip(blocks, widths)):
            for i in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (i == 0 and stage > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class DeepMLP(nn.Module):
    """Many small layers: hundreds of small gradients per step, where per-tensor costs dominate communication."""

    def __init__(self, depth=100, width=64, image_size=32, classes=10):
        super().__init__()
        self.stem = nn.Linear(3 * image_size * image_size, width)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(self.layers(F.relu(self.stem(x.flatten(1)))))


MODELS = {
    "resnet18": lambda: ResNet([2, 2, 2, 2]),
    "resnet34": lambda: ResNet([3, 4, 6, 3]),
    "resnet18_half": lambda: ResNet([2, 2, 2, 2], width=0.5),
    "resnet_tiny": lambda: ResNet([1, 1, 1, 1], width=0.25, classes=10),
}
SIZED_MODELS = {  # built for the image size
    "mlp_deep": lambda image_size: DeepMLP(image_size=image_size),
    "mlp_wide": lambda image_size: DeepMLP(depth=8, width=1024, image_size=image_size),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS) + sorted(SIZED_MODELS),
                        help="model to benchmark (mlp_deep: 100 small layers, 200 small gradients; "
                        "mlp_wide: 8 layers of 1024x1024, 4 MiB gradients)")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--image-size", type=int, default=64, help="side of the square random images")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", default=True, help="accepted; this build trains on the CPU")
    parser.add_argument("--use-adasum", action="store_true",
                        help="combine updates with Adasum instead of averaging gradients")
    parser.add_argument("--autotune", action="store_true",
                        help="tune fusion, cycle time and bucket size while training (as shmcommrun --autotune)")
    parser.add_argument("--backend", default="shmcomm",
                        choices=["shmcomm", "ddp-gloo", "ddp-shmcomm", "ddp-backend", "fsdp-gloo", "fsdp-backend"],
                        help="how gradients are averaged: DistributedOptimizer; DDP over gloo, with shmcomm's hook, "
                             "or on the shmcomm backend; FSDP2 over gloo or on the shmcomm backend")
    return parser.parse_args()


def wrap_for_backend(args, model, optimizer):
    """Returns (model, optimizer) set up for the chosen gradient transport."""
    if args.backend == "shmcomm":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        return model, hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                               compression=compression,
                                               op=hvd.Adasum if args.use_adasum else hvd.Average)
    import torch.distributed as dist

    # A file rendezvous named after the job token: no port to agree on, nothing on the network.
    path = os.path.join(tempfile.gettempdir(), "shmcomm_ddp_%s" % os.environ.get("SHMCOMM_JOB_TOKEN", "solo"))
    backend = "shmcomm" if args.backend.endswith("-backend") else "gloo"
    dist.init_process_group(backend, init_method="file://" + path, rank=hvd.rank(), world_size=hvd.size())
    if args.backend.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (hvd.size(),))
        for block in model.children():
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # the parameters are now sharded tensors: the optimizer takes them in place of the originals
        return model, type(optimizer)(model.parameters(), **optimizer.defaults)
    ddp = nn.parallel.DistributedDataParallel(model)
    if args.backend == "ddp-shmcomm":
        ddp.register_comm_hook(None, hvd.allreduce_hook)
    return ddp, optimizer


def main():
    args = parse_args()
    if args.use_adasum and args.backend != "shmcomm":
        raise SystemExit("--use-adasum needs --backend shmcomm")
    if args.autotune:
        os.environ["HOROVOD_AUTOTUNE"] = "1"  # read when the engine starts, in hvd.init()
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = SIZED_MODELS[args.model](args.image_size) if args.model in SIZED_MODELS else MODELS[args.model]()
    # Adasum adapts the combined step to how much the ranks' updates agree: the learning rate is not scaled by size.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * (1 if args.use_adasum else hvd.size()))
    model, optimizer = wrap_for_backend(args, model, optimizer)
    classes = model.module.fc.out_features if hasattr(model, "module") else model.fc.out_features
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, classes, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log("Model: %s" % args.model)
    log("Batch size: %d" % args.batch_size)
    log("Number of CPUs: %d" % hvd.size())
    log("Backend: %s%s, %d math thread(s) per rank" % (args.backend, " with Adasum" if args.use_adasum else "",
                                                         torch.get_num_threads()))
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log("Iter #%d: %.1f img/sec per CPU" % (x, img_sec))
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log("Img/sec per CPU: %.1f +-%.1f" % (mean, conf))
    log("Total img/sec on %d CPU(s): %.1f +-%.1f" % (hvd.size(), hvd.size() * mean, hvd.size() * conf))
    if args.backend != "shmcomm":
        import torch.distributed as dist

        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
