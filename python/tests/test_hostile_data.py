"""Users' data files through the Python door (issue 49): errors name the file and the line, whatever
bytes the file holds; the documented dataset formats are accepted by their documented names."""

import json

import pytest

import megatrain as mt


def letters_tokenizer(folder, chat_template=None):
    """One token per lowercase letter and space (ids 0-26) and <eos> (27), no merges."""
    folder.mkdir()
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    vocab["<eos>"] = 27
    tok = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []},
           "added_tokens": [{"id": 27, "content": "<eos>", "special": True}]}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = {"eos_token": "<eos>"}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def trainer(tmp_path, dataset):
    mt.init(rig="cpu-dev-2core")
    args = mt.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, max_seq_length=8, per_device_train_batch_size=1)
    return mt.Trainer(model="tiny-llama-gqa", args=args, train_dataset=dataset)


def test_invalid_utf8_in_a_jsonl_line_is_named_by_file_and_line(tmp_path):
    # The error's message carried the line's bytes, and turning it into Python text raised
    # UnicodeDecodeError naming neither the file nor the line.
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ab"}\n{"text": "c \xff\xfe d"}\n')
    t = trainer(tmp_path, mt.load_dataset(str(bad), tokenizer=letters_tokenizer(tmp_path / "tok")))
    with pytest.raises(ValueError) as e:
        t.plan()
    assert not isinstance(e.value, UnicodeDecodeError)
    assert "bad.jsonl:2" in str(e.value), str(e.value)


def test_the_documented_chat_format_is_accepted_and_others_are_named(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}) + "\n")
    template = "{% for m in messages %}{{ m.role[0] }} {{ m.content }}<eos>{% endfor %}"
    tok = letters_tokenizer(tmp_path / "tok", chat_template=template)
    plan = trainer(tmp_path, mt.load_dataset(str(chat), tokenizer=tok, format="chat")).plan()
    assert plan["feasible"], plan
    with pytest.raises(ValueError, match="format='xml': accepted: 'auto', 'text', 'alpaca', 'chat'"):
        mt.load_dataset(str(chat), tokenizer=tok, format="xml")


def test_a_second_trainer_on_the_same_output_dir_writes_nothing_while_the_first_holds_it(tmp_path):
    from conftest import rows
    mt.init(rig="cpu-dev-2core")

    def make(lr):
        args = mt.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, max_seq_length=32, per_device_train_batch_size=2,
                                    learning_rate=lr, logging_steps=1)
        return mt.Trainer(model="tiny-llama-gqa", args=args, train_dataset=rows(8, seed=3))

    first, second = make(1e-3), make(5e-4)
    first.plan()
    plan_file = tmp_path / "out" / "megatrain.plan.json"
    before = plan_file.read_bytes()
    with first._locked():  # as during first.train()
        with pytest.raises(RuntimeError, match=r"is in use by another Trainer \(pid \d+\)"):
            second.plan()
        assert plan_file.read_bytes() == before, "the refused Trainer rewrote the plan"
    # Between the two Trainers' plan() and the first's train(), the second wrote its own plan; the
    # first trains its own all the same (its learning rate is in its log).
    second.plan()
    assert json.loads(plan_file.read_text())["training"]["lr"] == 5e-4
    first.train()
    assert json.loads(plan_file.read_text())["training"]["lr"] == 1e-3
    assert first.state.log_history[0]["learning_rate"] > 0
