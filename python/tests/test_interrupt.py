"""Ctrl-C during Trainer.train(): a SIGINT sent to the Python process mid-run leaves a checkpoint at
the next step boundary and raises KeyboardInterrupt; resuming finishes bit for bit as a run that
was never interrupted."""

import os
import signal
import subprocess
import sys
import textwrap

from conftest import assert_same_tensors

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import megatrain as mt
    from conftest import rows
    mt.init(rig="cpu-dev-2core")
    args = mt.TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                max_steps=int(sys.argv[2]), learning_rate=1e-3, logging_steps=1, max_seq_length=32, seed=5)
    trainer = mt.Trainer(model="tiny-llama-gqa", args=args, train_dataset=rows(16, seed=11))
    try:
        trainer.train(resume_from_checkpoint=sys.argv[3] == "resume")
    except KeyboardInterrupt:
        print("INTERRUPTED at", trainer.state.global_step, flush=True)
        sys.exit(3)
    print("DONE", trainer.state.global_step, flush=True)
""")


def test_ctrl_c_saves_and_resuming_is_bit_exact(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    steps = 400
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    whole = subprocess.run([sys.executable, str(script), str(tmp_path / "whole"), str(steps), "new"], capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cut"), str(steps), "new"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step     3/"):
            p.send_signal(signal.SIGINT)
            break
    rest = p.stdout.read()
    p.wait(timeout=120)
    out = "".join(lines) + rest
    assert p.returncode == 3, out
    assert "stopped by SIGINT" in out
    at = int(out.split("INTERRUPTED at")[1].split()[0])
    assert 3 <= at < steps, out
    ckpt = tmp_path / "cut" / "checkpoints" / f"step-{at:08d}"
    assert (ckpt / "model.safetensors").is_file(), out

    again = subprocess.run([sys.executable, str(script), str(tmp_path / "cut"), str(steps), "resume"], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming from" in again.stdout
    last = f"step-{steps:08d}"
    assert_same_tensors(str(tmp_path / "whole" / "checkpoints" / last / "model.safetensors"),
                        str(tmp_path / "cut" / "checkpoints" / last / "model.safetensors"))
    assert_same_tensors(str(tmp_path / "whole" / "checkpoints" / last / "optimizer.safetensors"),
                        str(tmp_path / "cut" / "checkpoints" / last / "optimizer.safetensors"))


def test_sigterm_and_sighup_save_as_ctrl_c_does(tmp_path):
    # A scheduler's SIGTERM and a dropped session's SIGHUP ended the process without saving (issue 49):
    # now they stop at the next step boundary with a checkpoint, as Ctrl-C and megatrain-exec do.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        out_dir = tmp_path / sig.name
        p = subprocess.Popen([sys.executable, str(script), str(out_dir), "400", "new"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step     2/"):
                p.send_signal(sig)
                break
        rest = p.stdout.read()
        p.wait(timeout=120)
        out = "".join(lines) + rest
        assert p.returncode == 3, out
        at = int(out.split("INTERRUPTED at")[1].split()[0])
        assert 2 <= at < 400, out
        assert (out_dir / "checkpoints" / f"step-{at:08d}" / "model.safetensors").is_file(), out
