"""ImageNet training: a port of PyTorch's reference example (pytorch/examples, imagenet/main.py) onto fastio.

    fastio convert imagenet/train ds/train && fastio convert imagenet/val ds/val
    python examples/train_imagenet.py ds -a resnet50 --data-backend fastio
    torchrun --nproc-per-node 8 examples/train_imagenet.py ds -a resnet50 -b 2048 --lr 0.8
    python examples/train_imagenet.py imagenet --data-backend torchvision     # the same data, PyTorch's path

DATA holds ``train`` and ``val``: fastio datasets (``--data-backend fastio``: fastio.Loader, decoding and
augmenting with DALI) or image folders in ImageNet layout (``--data-backend torchvision``: ImageFolder and a
DataLoader with workers, as the reference example). Both apply the same augmentations: random resized crop
(scale 0.08..1, ratio 3/4..4/3), horizontal flip, normalisation; validation resizes the shorter side to
``crop / 0.875`` and takes the center crop. As in the reference: ResNet, SGD with momentum and weight decay, step
LR (``--lr-schedule cosine`` for cosine), top-1/top-5, ``checkpoint.pth.tar`` and ``model_best.pth.tar`` each
epoch, ``--resume``, ``--evaluate``; mixed precision where CUDA is present. Differences: processes come from
torchrun or srun (``env://``), not ``--multiprocessing-distributed``; ``-b`` is the global batch; no
``--dummy`` and no ``--pretrained`` (nothing is downloaded); the ResNets are defined here, as torchvision defines
them, so that this file runs where torchvision is not installed (the torchvision backend then uses equivalent
PIL transforms, defined below). The last line printed is ``best Acc@1 <value>``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EVAL_CROP_RATIO = 0.875  # 224 / 256

# -- models (torchvision's ResNet, without the downloads) --------------------------------------------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


ARCHS = {
    "resnet18": (BasicBlock, [2, 2, 2, 2], 64),
    "resnet34": (BasicBlock, [3, 4, 6, 3], 64),
    "resnet50": (Bottleneck, [3, 4, 6, 3], 64),
    "resnet101": (Bottleneck, [3, 4, 23, 3], 64),
    "resnet152": (Bottleneck, [3, 8, 36, 3], 64),
    "resnet10-w16": (BasicBlock, [1, 1, 1, 1], 16),  # a small one, for CPU runs and tests
}


def make_model(arch: str, num_classes: int) -> nn.Module:
    block, layers, width = ARCHS[arch]
    return ResNet(block, layers, num_classes, width)


# -- data --------------------------------------------------------------------------------------------------------


class FastioBatches:
    """fastio.Loader batches as ``(images, targets, real)``: ``real`` masks the validation's padding repeats."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for batch in self.loader:
            yield batch["image"], batch["label"], ~batch["padded"]


def fastio_loaders(args, rank: int, world: int, device: str):
    from fastio import ImageEval, ImageTrain, Loader

    common = dict(batch_size=args.batch_size // world, seed=args.seed, rank=rank, world_size=world, device=device,
                  num_threads=max(1, args.workers))
    train = Loader(os.path.join(args.data, "train"), pipeline=ImageTrain(size=args.crop), shuffle="global", **common)
    # remainder="partial": every validation sample once over all ranks (repeats, if any, flagged as padded)
    val = Loader(os.path.join(args.data, "val"), pipeline=ImageEval(size=args.crop, crop_ratio=EVAL_CROP_RATIO),
                 shuffle="none", remainder="partial", **common)
    classes = train.dataset.classifier_outputs()  # no labels: a DatasetError naming the dataset
    return FastioBatches(train), FastioBatches(val), classes


def _torchvision():
    try:
        import torchvision.datasets
        import torchvision.transforms
        return torchvision
    except Exception:  # not installed, or a build that does not match this torch
        return None


class PilTrainTransform:
    """torchvision's RandomResizedCrop(size) (scale 0.08..1, ratio 3/4..4/3, bilinear), RandomHorizontalFlip(),
    ToTensor(), Normalize(MEAN, STD), with the same random draws from torch's generator."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def params(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,)).item()
                left = torch.randint(0, width - w + 1, size=(1,)).item()
                return top, left, h, w
        in_ratio = width / height  # fallback: center crop
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            w, h = int(round(height * max(self.ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img):
        from PIL import Image

        top, left, h, w = self.params(*img.size)
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_normalized_tensor(img)


class PilEvalTransform:
    """torchvision's Resize(int(size / 0.875)) (shorter side, bilinear), CenterCrop(size), ToTensor, Normalize."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img):
        from PIL import Image

        short = int(self.size / EVAL_CROP_RATIO)
        w, h = img.size
        w, h = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
        img = img.resize((w, h), Image.Resampling.BILINEAR)
        top, left = int(round((h - self.size) / 2)), int(round((w - self.size) / 2))
        return to_normalized_tensor(img.crop((left, top, left + self.size, top + self.size)))


def to_normalized_tensor(img) -> torch.Tensor:
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


class PilImageFolder(torch.utils.data.Dataset):
    """torchvision's ImageFolder: class = index of its directory in sorted order; files in sorted order."""

    EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

    def __init__(self, root: str, transform):
        classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
        self.classes, self.transform = classes, transform
        self.samples = [(str(p), i) for i, c in enumerate(classes) for p in sorted(Path(root, c).rglob("*"))
                        if p.suffix.lower() in self.EXTENSIONS]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, target = self.samples[i]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), target


class TorchBatches:
    """A DataLoader's ``(images, targets)`` as ``(images, targets, real)``; ``set_epoch`` reaches its sampler."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self.loader.sampler, torch.utils.data.distributed.DistributedSampler):
            self.loader.sampler.set_epoch(epoch)

    def __iter__(self):
        for images, targets, real in self.loader:
            yield images, targets, real


class Marked(torch.utils.data.Dataset):
    """A dataset's items with ``real=True``: the validation sampler's repeats are marked False by the sampler."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        if i < 0:  # a repeat the UnpaddedSampler added to even out the ranks
            return (*self.dataset[-i - 1], False)
        return (*self.dataset[i], True)


class UnpaddedSampler(torch.utils.data.Sampler):
    """Rank r's share of 0..n-1 (strided, as DistributedSampler without shuffle); a rank left one short gets a
    repeat, passed as a negative index so that it is not counted (the reference example runs an extra loader
    over the remainder instead)."""

    def __init__(self, n: int, rank: int, world: int):
        self.mine = list(range(rank, n, world))
        per_rank = -(-n // world)
        self.mine += [-(self.mine[0]) - 1] * (per_rank - len(self.mine))

    def __len__(self) -> int:
        return len(self.mine)

    def __iter__(self):
        return iter(self.mine)


def torchvision_loaders(args, rank: int, world: int, device: str):
    tv = _torchvision()
    if tv is not None:
        T = tv.transforms
        normalize = T.Normalize(MEAN, STD)
        train_tf = T.Compose([T.RandomResizedCrop(args.crop), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        val_tf = T.Compose([T.Resize(int(args.crop / EVAL_CROP_RATIO)), T.CenterCrop(args.crop), T.ToTensor(),
                            normalize])
        folder = tv.datasets.ImageFolder
    else:
        train_tf, val_tf, folder = PilTrainTransform(args.crop), PilEvalTransform(args.crop), PilImageFolder
    train_set = Marked(folder(os.path.join(args.data, "train"), train_tf))
    val_set = Marked(folder(os.path.join(args.data, "val"), val_tf))
    per_rank = args.batch_size // world
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set, world, rank, seed=args.seed) \
        if world > 1 else None
    generator = torch.Generator().manual_seed(args.seed)
    pin = device == "cuda"
    train = torch.utils.data.DataLoader(train_set, per_rank, shuffle=train_sampler is None, sampler=train_sampler,
                                        num_workers=args.workers, pin_memory=pin, generator=generator,
                                        persistent_workers=args.workers > 0)
    val = torch.utils.data.DataLoader(val_set, per_rank, sampler=UnpaddedSampler(len(val_set), rank, world),
                                      num_workers=args.workers, pin_memory=pin)
    return TorchBatches(train), TorchBatches(val), len(train_set.dataset.classes)


# -- training ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ImageNet training on fastio (or torchvision) data")
    p.add_argument("data", metavar="DIR", help="holds train/ and val/ (fastio datasets, or image folders)")
    p.add_argument("--data-backend", choices=("fastio", "torchvision"), default="fastio")
    p.add_argument("-a", "--arch", default="resnet18", choices=sorted(ARCHS))
    p.add_argument("-j", "--workers", type=int, default=4,
                   help="data threads (fastio: DALI threads) or DataLoader worker processes (torchvision)")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--start-epoch", type=int, default=0, help="manual epoch number (useful on restarts)")
    p.add_argument("-b", "--batch-size", type=int, default=256, help="global batch over all processes")
    p.add_argument("--lr", "--learning-rate", type=float, default=0.1, dest="lr")
    p.add_argument("--lr-schedule", choices=("step", "cosine"), default="step",
                   help="step: x0.1 every 30 epochs (the reference); cosine: to 0 over --epochs")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    p.add_argument("--crop", type=int, default=224, help="training crop and validation crop side")
    p.add_argument("-p", "--print-freq", type=int, default=10)
    p.add_argument("--resume", default="", metavar="PATH", help="a checkpoint.pth.tar to continue from")
    p.add_argument("-e", "--evaluate", action="store_true", help="evaluate the model on the validation set")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the data order and augmentation")
    p.add_argument("--out", default=".", help="where checkpoint.pth.tar and model_best.pth.tar go (made if needed)")
    p.add_argument("--no-amp", action="store_true", help="no mixed precision on CUDA")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.epochs < 0 or args.crop < 8:
        p.error("--batch-size must be >= 1, --epochs >= 0, --crop >= 8")
    if args.resume and not os.path.isfile(args.resume):
        p.error(f"--resume {args.resume}: no such checkpoint file")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: a file, not a folder")
    return args


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    world, rank, local = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
    cuda = torch.cuda.is_available()
    if world > 1:
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} is not a multiple of the {world} processes")
    device = "cuda" if cuda else "cpu"
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    make = fastio_loaders if args.data_backend == "fastio" else torchvision_loaders
    train_loader, val_loader, num_classes = make(args, rank, world, device)
    model = make_model(args.arch, num_classes).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if args.lr_schedule == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    else:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.epochs))
    scaler = torch.amp.GradScaler("cuda", enabled=cuda and not args.no_amp)

    best_acc1 = 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
        args.start_epoch, best_acc1 = checkpoint["epoch"], float(checkpoint["best_acc1"])
        unwrap(model).load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")

    if args.evaluate:
        return validate(val_loader, model, criterion, args, device)

    for epoch in range(args.start_epoch, args.epochs):
        train_loader.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, scaler, epoch, args, device)
        acc1 = validate(val_loader, model, criterion, args, device)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if rank == 0:
            save_checkpoint({"epoch": epoch + 1, "arch": args.arch, "state_dict": unwrap(model).state_dict(),
                             "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict()}, is_best, args.out)
    if rank == 0:
        print(f"best Acc@1 {best_acc1:.3f}")
    if world > 1:
        dist.destroy_process_group()
    return best_acc1


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def train(train_loader, model, criterion, optimizer, scaler, epoch, args, device):
    batch_time, data_time = AverageMeter("Time", ":6.3f"), AverageMeter("Data", ":6.3f")
    losses, top1, top5 = AverageMeter("Loss", ":.4e"), AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(len(train_loader), [batch_time, data_time, losses, top1, top5],
                             prefix=f"Epoch: [{epoch}]")
    model.train()
    end = time.time()
    for i, (images, target, _) in enumerate(train_loader):
        data_time.update(time.time() - end)
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.float16, enabled=scaler.is_enabled()):
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0].item(), images.size(0))
        top5.update(acc5[0].item(), images.size(0))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        batch_time.update(time.time() - end)
        end = time.time()
        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args, device) -> float:
    """Top-1 over every validation sample once (all ranks' sums reduced; padding repeats not counted)."""
    batch_time = AverageMeter("Time", ":6.3f", Summary.NONE)
    losses, top1, top5 = (AverageMeter("Loss", ":.4e", Summary.NONE), AverageMeter("Acc@1", ":6.2f", Summary.AVERAGE),
                          AverageMeter("Acc@5", ":6.2f", Summary.AVERAGE))
    progress = ProgressMeter(len(val_loader), [batch_time, losses, top1, top5], prefix="Test: ")
    model.eval()
    with torch.no_grad():
        end = time.time()
        for i, (images, target, real) in enumerate(val_loader):
            images, target, real = images.to(device), target.to(device), real.to(device)
            with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda" and not args.no_amp):
                output = model(images)
            if not bool(real.any()):
                continue
            output, target = output[real], target[real]
            loss = criterion(output.float(), target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(loss.item(), target.size(0))
            top1.update(acc1[0].item(), target.size(0))
            top5.update(acc5[0].item(), target.size(0))
            batch_time.update(time.time() - end)
            end = time.time()
            if i % args.print_freq == 0:
                progress.display(i + 1)
    if dist.is_initialized():
        for meter in (top1, top5):
            meter.all_reduce(device)
    progress.display_summary()
    return top1.avg


def save_checkpoint(state: dict, is_best: bool, out: str, filename: str = "checkpoint.pth.tar") -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, filename)
    torch.save(state, path + ".tmp")  # a crash leaves no half-written checkpoint.pth.tar
    os.replace(path + ".tmp", path)
    if is_best:
        shutil.copyfile(path, os.path.join(out, "model_best.pth.tar.tmp"))
        os.replace(os.path.join(out, "model_best.pth.tar.tmp"), os.path.join(out, "model_best.pth.tar"))


class Summary(Enum):
    NONE, AVERAGE, SUM, COUNT = range(4)


class AverageMeter:
    """Computes and stores the average and current value."""

    def __init__(self, name: str, fmt: str = ":f", summary_type: Summary = Summary.AVERAGE):
        self.name, self.fmt, self.summary_type = name, fmt, summary_type
        self.val = self.avg = self.sum = self.count = 0.0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self, device: str) -> None:
        total = torch.tensor([self.sum, self.count], dtype=torch.float64, device=device)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / max(self.count, 1)

    def __str__(self) -> str:
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)

    def summary(self) -> str:
        if self.summary_type is Summary.NONE:
            return ""
        key = {Summary.AVERAGE: "avg", Summary.SUM: "sum", Summary.COUNT: "count"}[self.summary_type]
        return f"{self.name} {getattr(self, key):.3f}"


class ProgressMeter:
    def __init__(self, num_batches: int, meters: list[AverageMeter], prefix: str = ""):
        digits = len(str(num_batches))
        self.batch_fmtstr = "[{:" + str(digits) + "d}/" + str(num_batches) + "]"
        self.meters, self.prefix = meters, prefix

    def display(self, batch: int) -> None:
        entries = [self.prefix + self.batch_fmtstr.format(batch)] + [str(m) for m in self.meters]
        print("\t".join(entries), flush=True)

    def display_summary(self) -> None:
        print(" ".join(["*"] + [m.summary() for m in self.meters if m.summary()]), flush=True)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[torch.Tensor]:
    """Accuracy (percent) over the k top predictions, for each k."""
    with torch.no_grad():
        maxk = min(max(topk), output.size(1))
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:min(k, maxk)].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / target.size(0))
                for k in topk]


if __name__ == "__main__":
    from fastio import exit_cleanly

    # A missing or broken dataset, or Ctrl-C: one line, not a traceback.
    with exit_cleanly(resume="checkpoint.pth.tar holds the last finished epoch: --resume it to continue"):
        main()
