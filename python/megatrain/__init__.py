"""MegaTrain: train a large language model on one GPU (or the CPU) whose training state is far larger
than GPU memory, with the weights, gradients and Adam states in host RAM and on NVMe.

    import megatrain as mt
    mt.init(offload_dir="/mnt/nvme/megatrain", max_vram_gb=80)
    model = mt.Model.from_pretrained("path/to/hf-model")
    trainer = mt.Trainer(model=model, train_dataset=mt.load_dataset("data.jsonl", tokenizer="path/to/hf-model"),
                         args=mt.TrainingArguments(output_dir="out", per_device_train_batch_size=1,
                                                   gradient_accumulation_steps=128))
    print(trainer.plan()["plan"]["predicted"])
    trainer.train()

Every name is documented in docs/python.md. The training itself runs in C++ (the engine under
megatrain-exec), with the GIL released.
"""

import os as _os

# The model and rig profiles ship inside the package (profiles/); an explicit MEGATRAIN_PROFILES_DIR wins.
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.environ.get("MEGATRAIN_PROFILES_DIR") and _os.path.isdir(_os.path.join(_here, "profiles", "models")):
    _os.environ["MEGATRAIN_PROFILES_DIR"] = _os.path.join(_here, "profiles")

from . import _megatrain  # noqa: E402
from .config import Settings, init, settings  # noqa: E402
from .data import Dataset, load_dataset  # noqa: E402
from .errors import CheckpointError, PlanError  # noqa: E402
from .model import Model  # noqa: E402
from .tools import inspect, simulate, size  # noqa: E402
from .trainer import Trainer, TrainerControl, TrainerState, TrainingArguments, TrainOutput  # noqa: E402

__version__ = "0.1.0"

__all__ = ["init", "settings", "Settings", "Model", "Dataset", "load_dataset", "TrainingArguments", "Trainer", "TrainerState",
           "TrainerControl", "TrainOutput", "PlanError", "CheckpointError", "inspect", "simulate", "size", "__version__"]
