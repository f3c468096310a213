"""Prompts too long for the context are refused by their length before any tokenising, by a bound that
never refuses a prompt that fits: eight concurrent 3.8 MB prompts cost the server little memory and are
refused at once; the bound holds on adversarial texts for a character, a byte-level, a SentencePiece and
an NFC-normalising tokenizer, and pipelines that may drop or fold text get none."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import unicodedata
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from data.toy_tokenizer import build_char_tokenizer
from inference.server.prompt_bound import COMPOSING, chars_per_token
from tests import real_tokenizers
from tests.conftest import REPO
from tests.tiny import tiny_checkpoint

HUGE = "a b " * 950_000  # 3.8 MB, under the 4 MiB body limit


def nfc_byte_level():
    from tokenizers import normalizers

    tok = real_tokenizers.byte_level()
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    return tok


TOKENIZERS = {
    "char": build_char_tokenizer,
    "byte-level": real_tokenizers.byte_level,
    "sentencepiece": real_tokenizers.sentencepiece,
    "nfc-byte-level": nfc_byte_level,
}


def adversarial_texts(tok) -> list[str]:
    """Texts that pack as many characters into each token as this tokenizer allows."""
    vocab = sorted(tok.get_vocab(), key=len, reverse=True)
    longest = [tok.convert_tokens_to_string([t]) for t in vocab[:20]]
    specials = [t for t in tok.all_special_tokens]
    return [
        "".join(longest) * 20,
        "".join(specials) * 50,
        " ".join(longest + specials) * 10,
        "é 한 " * 100 + "\u1e17" * 50,
        "e\u0304\u0301" * 200 + "\u1100\u1161\u11a8" * 200,  # what NFC folds three to one
        HUGE[:4000],
        " " * 3000 + "\n" * 3000,
    ]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_no_text_packs_more_characters_into_a_token_than_the_bound(name):
    tok = TOKENIZERS[name]()
    m = chars_per_token(tok)
    assert m is not None
    for text in adversarial_texts(tok):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) * m >= len(text)


def test_an_added_token_longer_than_every_vocabulary_string_sets_the_bound():
    """Added tokens live outside the model's vocabulary (`added_tokens` in tokenizer.json): a chat marker
    longer than every learnt string packs the most characters into one token, so the bound is its length."""
    tok = real_tokenizers.byte_level()  # learnt strings of at most 13 characters ("<|endoftext|>")
    marker = "<|start_header_id|>"
    tok.add_tokens([marker], special_tokens=True)
    assert marker not in json.loads(tok.backend_tokenizer.to_str())["model"]["vocab"]
    m = chars_per_token(tok)
    text = marker * 50
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert n * m >= len(text), f"{len(text)} characters in {n} tokens, bound {m} a token"
    assert (n, m) == (50, len(marker))  # and the bound is tight


def test_a_replace_normalizer_multiplies_the_bound_by_what_it_folds():
    """A normalizer that folds Windows line ends "\r\n" into "\n" halves the text before the model sees
    it; with a learnt run of 16 newlines (as code tokenizers have), one token stands for 32 characters."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.Replace("\r\n", "\n")
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    texts = ["\n" * 16, *real_tokenizers.TEXTS]
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    m = chars_per_token(tok)
    text = "\r\n" * 16 * 30
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert n * m >= len(text), f"{len(text)} characters in {n} tokens, bound {m} a token"
    assert (n, m) == (30, 2 * 16)  # and the bound is tight


def test_nfc_and_nfkc_fold_at_most_composing_characters_into_one():
    longest = max(
        len(unicodedata.normalize("NFD", chr(c)))
        for c in range(sys.maxunicode + 1)
        if unicodedata.normalize("NFC", chr(c)) == chr(c)
    )
    assert longest == COMPOSING


def _with(tok, **parts):
    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    for key, value in parts.items():
        if key == "model":
            spec["model"].update(value)
        elif key == "added":
            spec["added_tokens"][-1].update(value)
        else:
            spec[key] = value
    return type(tok)(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


@pytest.mark.parametrize(
    "base,parts",
    [
        ("byte-level", {"pre_tokenizer": {"type": "Whitespace"}}),  # drops whitespace
        ("byte-level", {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}),
        ("byte-level", {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}}),
        ("byte-level", {"added": {"lstrip": True}}),  # swallows the whitespace before it
        ("sentencepiece", {"model": {"byte_fallback": False, "fuse_unk": True}}),  # a run of unknowns: one token
        ("char", {"pre_tokenizer": BYTE_LEVEL}),  # a word-level model on unbounded words
    ],
)
def test_pipelines_that_may_drop_or_fold_text_get_no_bound(base, parts):
    assert chars_per_token(_with(TOKENIZERS[base](), **parts)) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, path, body, timeout=120):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """serve.py in its own process (its memory is what is measured), on a tiny checkpoint."""
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "inference/serve.py", str(ckpt), "--mode", "causal", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
                time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_concurrent_huge_prompts_are_refused_at_once_in_little_memory(served, kind):
    import psutil

    url, proc = served
    server = psutil.Process(proc.pid)
    path, body = (
        ("/v1/completions", {"prompt": HUGE, "max_tokens": 4})
        if kind == "completion"
        else ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4})
    )
    small = {"prompt": "ab"} if kind == "completion" else {"messages": [{"role": "user", "content": "ab"}]}
    assert _post(url, path, {**small, "max_tokens": 2})[0] == 200  # what any request costs is in the baseline
    base, peak, done = server.memory_info().rss, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], server.memory_info().rss)
            if peak[0] - base > 3 * 2**30:  # a regression must not take the machine down with it
                proc.kill()
                return
            time.sleep(0.01)

    def timed():
        t0 = time.perf_counter()
        try:
            status, reply = _post(url, path, body)
        except OSError as e:  # the server was killed (see watch)
            status, reply = None, repr(e)
        return status, reply, time.perf_counter() - t0

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: timed(), range(8)))
    finally:
        done.set()
        watcher.join()
    grown = (peak[0] - base) / 2**20
    print(f"{kind}: RSS {base / 2**20:.0f} MB, peak +{grown:.0f} MB, slowest {max(r[2] for r in results):.2f} s")
    assert grown < 500, f"server RSS grew by {grown:.0f} MB (killed past 3 GB)"
    for status, reply, seconds in results:
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        # tokenising every prompt first took 8.5 s a request (issue 40, D8b); 3 s leaves room for a loaded machine
        assert seconds < 3.0, [round(r[2], 2) for r in results]
    after = (server.memory_info().rss - base) / 2**20
    assert after < 200, f"the server kept {after:.0f} MB after refusing them"
    status, reply = _post(url, "/v1/completions", {"prompt": "ab", "max_tokens": 2})
    assert status == 200, reply


@pytest.mark.e2e
def test_a_prompt_that_fits_is_served_however_dense(served):
    """The longest token 1016 times: as many characters as the bound lets through, in a prompt that fits."""
    url, _ = served
    status, reply = _post(url, "/v1/completions", {"prompt": "<|endoftext|>" * 1016, "max_tokens": 4})
    assert status == 200 and reply["usage"]["prompt_tokens"] == 1016, reply
    status, reply = _post(url, "/v1/completions", {"prompt": "<|endoftext|>" * 1021, "max_tokens": 4})
    assert status == 400 and "1025 tokens" in reply["error"]["message"], reply  # refused by its tokens
