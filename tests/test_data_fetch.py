"""data.fetch: row converters and the checksummed writer (the hub itself is not reachable in CI)."""

import hashlib

from data.fetch import SOURCES, main, write_jsonl


def test_converters_produce_trainer_and_eval_forms():
    chat = SOURCES["ultrachat"].convert(
        {"prompt": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    assert chat == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    sg = SOURCES["openhermes"].convert(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    )
    assert sg == {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert SOURCES["ultrachat"].convert({"messages": []}) is None
    g = SOURCES["gsm8k"].convert({"question": "q", "answer": "#### 1", "extra": 5})
    assert g == {"question": "q", "answer": "#### 1"}


def test_writer_limits_skips_and_checksums(tmp_path):
    rows = [{"messages": [{"role": "user", "content": str(i)}]} for i in range(5)] + [{"messages": []}]
    out = tmp_path / "d.jsonl"
    written, skipped, sha = write_jsonl(rows, SOURCES["tulu3"].convert, out)
    assert (written, skipped) == (5, 1)
    assert sha == hashlib.sha256(out.read_bytes()).hexdigest()
    assert (tmp_path / "d.jsonl.sha256").read_text().split()[0] == sha
    assert write_jsonl(rows, SOURCES["tulu3"].convert, out, limit=2)[0] == 2 and len(out.read_text().splitlines()) == 2


def test_list(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SOURCES)
