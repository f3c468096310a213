"""The data pipeline: conversation formats, chat-template prefix rule, skips counted by reason."""

import json

import pytest

from data.toy_tokenizer import build_char_tokenizer
from train.data import DataError, load_samples
from train.packing import RowStream, bucket_length, pack_first_fit
from train.special_tokens import end_of_turn_id


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _load(tok, tmp_path, lines, **kw):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    opts = dict(multiturn=False, max_length=10_000, max_response_length=None, bd_size=4, views=2)
    opts.update(kw)
    return load_samples(str(path), tok, end_of_turn_id(tok), **opts)


def conv(*turns):
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def test_single_turn_span_is_the_reply_and_end_of_turn(tok, tmp_path):
    samples, stats = _load(tok, tmp_path, [conv("hi", "yo!")])
    (s,) = samples
    ((start, end),) = s.spans
    assert tok.decode(s.input_ids[start:end]) == "yo!<|im_end|>"
    assert end == len(s.input_ids)
    assert tok.decode(s.input_ids[:start]).endswith("<|im_start|>assistant\n")
    assert stats.kept == 1 and not stats.skipped


def test_sharegpt_format_and_system_prompt(tok, tmp_path):
    rec = {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    samples, _ = _load(tok, tmp_path, [rec])
    s = samples[0]
    assert tok.decode(s.input_ids[s.spans[0][0] :]) == "a<|im_end|>"
    assert "be brief" in tok.decode(s.input_ids)


def test_multiturn_supervises_every_turn_single_turn_only_the_last(tok, tmp_path):
    c = conv("a", "b", "c", "d")
    one, _ = _load(tok, tmp_path, [c])
    many, _ = _load(tok, tmp_path, [c], multiturn=True)
    assert len(one[0].spans) == 1 and len(many[0].spans) == 2
    assert [tok.decode(many[0].input_ids[s:e]) for s, e in many[0].spans] == ["b<|im_end|>", "d<|im_end|>"]
    assert one[0].spans[0] == many[0].spans[1]


def test_bad_records_are_skipped_and_counted(tok, tmp_path):
    lines = [
        "{not json",
        json.dumps([1, 2]),
        {"text": "no messages"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
        conv("q" * 50, "a" * 60),
        conv("fine", "ok"),
    ]
    samples, stats = _load(tok, tmp_path, lines, max_length=200)
    assert len(samples) == 1 and stats.records == 9 and stats.kept == 1
    assert stats.skipped == {
        "malformed_json": 1,
        "not_an_object": 1,
        "no_messages": 1,
        "missing_role": 1,
        "unknown_role": 1,
        "no_assistant_turn": 1,
        "bad_content": 1,
        "too_long": 1,
    }
    _, stats2 = _load(tok, tmp_path, [conv("q", "a" * 30), conv("q", "ok")], max_response_length=10)
    assert stats2.skipped == {"response_too_long": 1}


def test_a_deeply_nested_line_is_a_malformed_line_not_a_recursion_error(tok, tmp_path):
    """json's parser recurses once per `[`: 100,000 of them raised RecursionError out of the data pipeline."""
    samples, stats = _load(tok, tmp_path, ["[" * 100_000, "[" * 100_000 + "]" * 100_000, conv("fine", "ok")])
    assert len(samples) == 1 and stats.records == 3 and stats.skipped == {"malformed_json": 2}


def test_template_mismatch_is_not_supervised(tok, tmp_path):
    # A template that renders past assistant turns differently (as thinking-stripping templates do)
    # and whose generation prompt differs from how it renders an assistant turn.
    t = build_char_tokenizer()
    t.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
        "{{ m['content'][:1] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    samples, stats = _load(t, tmp_path, [conv("a", "long reply", "c", "d")], multiturn=True)
    assert len(samples[0].spans) == 1 and stats.unsupervised_turns == {"template_mismatch": 1}
    t.chat_template = t.chat_template.replace(
        "{% if add_generation_prompt %}<|im_start|>assistant\n", "{% if add_generation_prompt %}<|im_start|>bot\n"
    )
    with pytest.raises(ValueError, match="no usable samples.*template_mismatch"):
        _load(t, tmp_path, [conv("a", "b")])


def test_missing_dataset_and_empty_directory_are_clear_errors(tok, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_samples(
            str(tmp_path / "nope.jsonl"),
            tok,
            2,
            multiturn=False,
            max_length=99,
            max_response_length=None,
            bd_size=4,
            views=2,
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .jsonl"):
        load_samples(
            str(tmp_path / "empty"),
            tok,
            2,
            multiturn=False,
            max_length=99,
            max_response_length=None,
            bd_size=4,
            views=2,
        )


def test_first_fit_packing_keeps_every_sample_within_capacity():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    for window in (1, 4, 64):
        rows = pack_first_fit(lengths, 128, window=window)
        assert sorted(i for r in rows for i in r) == list(range(500))
        assert all(sum(lengths[i] for i in r) <= 128 for r in rows)
    assert len(pack_first_fit(lengths, 128, window=64)) < len(pack_first_fit(lengths, 128, window=1))
    with pytest.raises(ValueError, match="capacity"):
        pack_first_fit([200], 128)


def test_row_stream_shards_ranks_disjointly_and_in_lockstep():
    world, mbs, n = 3, 2, 10
    streams = [RowStream(n, seed=1, world_size=world, rank=r, micro_batch_size=mbs) for r in range(world)]
    seen = []
    for _ in range(5):  # 5 micro-steps x 6 rows = 30 rows = 3 epochs
        seen.append([s.next_micro_batch() for s in streams])
    flat = [i for step in seen for rank in step for i in rank]
    for epoch in range(3):
        assert sorted(flat[epoch * n : (epoch + 1) * n]) == list(range(n)), "each epoch visits every row once"
    assert flat[:n] != flat[n : 2 * n], "epochs are reshuffled"
    assert all(s.position == 30 for s in streams)
    again = RowStream(n, seed=1, world_size=world, rank=1, micro_batch_size=mbs)
    again.position = 12
    assert again.next_micro_batch() == seen[2][1], "position alone resumes the stream"
    assert bucket_length(70, None) == 128 and bucket_length(70, [64, 96, 256]) == 96


def test_non_utf8_line_is_skipped_and_counted_and_a_bom_is_not(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps(conv("hi", "yo")).encode()
    path.write_bytes(
        b"\xef\xbb\xbf" + good + b"\n" + '{"messages": "caf\xe9"}'.encode("latin-1") + b"\n" + good + b"\n"
    )
    samples, stats = load_samples(
        str(path),
        tok,
        end_of_turn_id(tok),
        multiturn=False,
        max_length=10_000,
        max_response_length=None,
        bd_size=4,
        views=2,
    )
    assert stats.records == 3 and stats.kept == 2 and len(samples) == 2
    assert stats.skipped == {"not_utf8": 1}


def test_list_content_of_non_text_items_is_skipped_and_text_parts_are_joined(tok, tmp_path):
    image = [{"type": "image", "image": "cat.png"}]
    lines = [
        {"messages": [{"role": "user", "content": image}, {"role": "assistant", "content": "a cat"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [1, 2]}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "he"}, "llo"]},
                {"role": "assistant", "content": "ok"},
            ]
        },
    ]
    samples, stats = _load(tok, tmp_path, lines)
    assert stats.skipped == {"non_text_content": 2} and stats.kept == 1
    text = tok.decode(samples[0].input_ids)
    assert "<|im_start|>user\nhello<|im_end|>" in text and "[" not in text


def test_data_errors_carry_the_stats_and_name_the_flag(tok, tmp_path):
    opts = dict(multiturn=False, max_length=99, max_response_length=None, bd_size=4, views=2)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match="--dataset") as e:
        load_samples(str(tmp_path / "bad.jsonl"), tok, 2, **opts)
    assert e.value.stats.skipped == {"malformed_json": 1} and "\n" not in str(e.value)
