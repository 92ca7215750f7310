"""Fine-tune a model with MegaTrain's Python API, in the shape of Hugging Face's Trainer.

Usage: finetune.py MODEL_DIR DATA OUTPUT_DIR [STEPS]
MODEL_DIR is a Hugging Face model folder (config.json, tokenizer.json, and safetensors weights if it
has any: without them training starts from a random initialisation); DATA an alpaca, chat or text
file. With transformers installed the model is a transformers object, updated in place by train().
"""
import sys

import megatrain as mt

model_dir, data, out = sys.argv[1:4]
mt.init(offload_dir=f"{out}/megatrain_cache", max_ram_gb=8, optimizer_compression=False)
try:  # a transformers model object, as in Hugging Face's own examples
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch
    has_weights = any(f.endswith(".safetensors") for f in __import__("os").listdir(model_dir))
    model = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if has_weights
             else AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))
except ImportError:
    model = mt.Model.from_pretrained(model_dir)
args = mt.TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                            max_steps=int(sys.argv[4]) if len(sys.argv) > 4 else 30, logging_steps=5, max_seq_length=128)
trainer = mt.Trainer(model=model, args=args, train_dataset=mt.load_dataset(data, tokenizer=model_dir))
plan = trainer.plan()
print(f"plan: {plan['plan']['predicted']['tokens_per_s']:.0f} tokens/s predicted, bottleneck {plan['bottleneck']['resource']}")
trainer.train()
for entry in trainer.state.log_history:
    print(entry)
print("saved to", trainer.save_model())
