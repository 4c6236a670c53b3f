"""The shipped tokenizer: task strings, determinism, and identical ids in HF and vLLM."""

from __future__ import annotations

import json
import pickle
import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe_rl.config import ModelConfig
from moe_rl.tasks import AddTask, ReverseTask, SortTask, sft_examples
from moe_rl.tasks.tokenizer import (
    ASCII_CHARS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SHIPPED_MODEL,
    UNK_ID,
    Tokenizer,
    build_hf_tokenizer,
    load_sentencepiece,
    train_tokenizer,
    training_corpus,
    write_hf_tokenizer,
)

ASCII_TEXT = st.text(alphabet=st.sampled_from(list(string.printable[:95])), max_size=40)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


@pytest.fixture(scope="module")
def hf_pipeline():
    """The `tokenizers` object written to tokenizer.json (what vLLM's detokenizer steps)."""
    return build_hf_tokenizer()


def task_texts(n: int = 100) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from every synthetic task, short and long operands."""
    pairs = []
    for task in (ReverseTask(1, 8), SortTask(1, 8), AddTask(1, 3), AddTask(4, 6)):
        pairs += sft_examples(task, n, seed=11)
    return pairs


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """Tokenizer files alone, and inside a Qwen3-MoE model directory (the converter's layout)."""
    from transformers import Qwen3MoeConfig

    bare = write_hf_tokenizer(tmp_path_factory.mktemp("bare"))
    model = write_hf_tokenizer(tmp_path_factory.mktemp("qwen3_moe"))
    Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, intermediate_size=64, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    ).save_pretrained(model)  # fmt: skip
    return {"bare": str(bare), "qwen3_moe": str(model)}


# --------------------------------------------------------------------------- the model


def test_shipped_model_is_small_and_fits_the_model(tok):
    assert SHIPPED_MODEL.is_file() and SHIPPED_MODEL.stat().st_size < 8_000
    assert tok.vocab_size == 128 <= ModelConfig().vocab_size
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert tok.pieces([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]


def test_digits_are_single_tokens(tok):
    digit_ids = set()
    for d in string.digits:
        (i,) = tok.encode(d)
        assert tok.pieces([i]) == [d]
        digit_ids.add(i)
    assert len(digit_ids) == 10
    ids = tok.encode(" 9081726354")
    assert tok.pieces(ids) == ["▁", *"9081726354"]
    # no piece anywhere in the vocabulary holds a digit next to anything else
    vocab = tok.pieces(range(tok.vocab_size))
    assert all(len(p) == 1 for p in vocab if any(c.isdigit() for c in p))


def test_every_printable_ascii_char_is_known(tok):
    assert UNK_ID not in tok.encode(ASCII_CHARS + " ")
    assert tok.encode("αβ x") == [UNK_ID, *tok.encode(" x")]


def test_task_strings_round_trip_and_split_cleanly(tok):
    for prompt, completion in task_texts():
        p_ids, c_ids = tok.encode_example(prompt, completion)
        assert tok.decode(p_ids) == prompt and tok.decode(c_ids) == completion
        assert c_ids[-1] == EOS_ID and EOS_ID not in p_ids and BOS_ID not in p_ids
        # the learner may tokenize prompt and response separately or together
        assert p_ids + c_ids[:-1] == tok.encode(prompt + completion)


def test_token_budgets(tok):
    """Default digit range (4-6): prompts fit 16 tokens, answers + EOS fit 10."""
    for task in (ReverseTask(4, 6), SortTask(4, 6), AddTask(4, 6)):
        for prompt, completion in sft_examples(task, 200, seed=0):
            p_ids, c_ids = tok.encode_example(prompt, completion)
            assert len(p_ids) <= 16 and len(c_ids) <= 10, (prompt, completion)
    assert len(tok.encode("rev 482130 =")) == 9  # keyword, "▁", 6 digits, "▁="


@settings(max_examples=200, deadline=None)
@given(text=ASCII_TEXT)
def test_ascii_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_bos_eos_and_decode_robustness(tok):
    ids = tok.encode("rev 12 =")
    assert tok.encode("rev 12 =", bos=True, eos=True) == [BOS_ID, *ids, EOS_ID]
    assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == "rev 12 ="
    assert tok.decode([*ids, 128, 5000, -1]) == "rev 12 ="  # padded-vocab ids are dropped
    assert tok.decode([]) == ""


def test_pickle_and_loading(tok, tmp_path):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("sort 321 =") == tok.encode("sort 321 =")
    assert load_sentencepiece("").path == SHIPPED_MODEL
    assert load_sentencepiece(str(SHIPPED_MODEL)).vocab_size == 128
    with pytest.raises(FileNotFoundError, match=r"missing\.model"):
        load_sentencepiece(tmp_path / "missing.model")


def test_retraining_reproduces_the_shipped_model(tmp_path, tok):
    path = train_tokenizer(tmp_path / "again.model")
    again = Tokenizer(path)
    ids = range(tok.vocab_size)
    assert again.pieces(ids) == tok.pieces(ids)
    assert path.read_bytes() == SHIPPED_MODEL.read_bytes()


def test_training_corpus_is_deterministic():
    assert training_corpus() == training_corpus()


# --------------------------------------------------------------------------- HF / vLLM


SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")


@settings(max_examples=300, deadline=None)
@given(text=ASCII_TEXT)
def test_hf_pipeline_matches_sentencepiece(tok, hf_pipeline, text):
    assume(not any(p in text for p in SPECIAL_PIECES))  # the one divergence: next test
    assert hf_pipeline.encode(text).ids == tok.encode(text)


def test_special_piece_spelled_in_text_is_the_one_divergence(tok, hf_pipeline):
    """Hugging Face tokenizers read a special token's text ("<s>") in the input as that
    token, as every HF tokenizer does (Qwen's "<|im_end|>" included); SentencePiece spells
    it out. The task prompts never contain these strings; found by the property test above."""
    assert hf_pipeline.encode("a<s>b").ids == [*tok.encode("a"), tok.bos_id, *hf_pipeline.encode("b").ids]
    assert tok.encode("<s>") == [93, 48, 94]


def test_hf_files(tok, hf_dirs):
    config = json.loads(open(f"{hf_dirs['bare']}/tokenizer_config.json").read())
    assert config["add_bos_token"] is False and config["eos_token"] == "</s>"
    assert open(f"{hf_dirs['bare']}/tokenizer.model", "rb").read() == SHIPPED_MODEL.read_bytes()
    # the learner can load the tokenizer from the model directory itself
    assert load_sentencepiece(hf_dirs["qwen3_moe"]).encode("rev 12 =") == tok.encode("rev 12 =")


@pytest.mark.parametrize("layout", ["bare", "qwen3_moe"])
def test_auto_tokenizer_matches(tok, hf_dirs, layout):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dirs[layout])
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert len(hf) == tok.vocab_size
    for prompt, completion in task_texts(50):
        # default call: add_special_tokens=True must still add nothing (no silent BOS)
        assert hf(prompt)["input_ids"] == tok.encode(prompt)
        assert hf.encode(completion) == tok.encode(completion)
        c_ids = tok.encode(completion, eos=True)
        assert hf.decode(c_ids, skip_special_tokens=True) == completion


def test_incremental_detokenization_keeps_the_leading_space(tok, hf_pipeline):
    """What vLLM's fast detokenizer does: a DecodeStream primed with the prompt ids."""
    from tokenizers.decoders import DecodeStream

    prompt_ids, c_ids = tok.encode_example("rev 48213 =", " 31284")
    stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
    assert "".join(stream.step(hf_pipeline, i) or "" for i in c_ids) == " 31284"


def test_export_rejects_other_sentencepiece_models(tmp_path):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["hello world"] * 50), model_prefix=str(tmp_path / "uni"),
        vocab_size=12, minloglevel=2, num_threads=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"model_type is not bpe.*add_dummy_prefix"):
        write_hf_tokenizer(tmp_path / "hf", tmp_path / "uni.model")


@pytest.mark.vllm
def test_vllm_tokenizer_matches(tok, hf_dirs):
    vllm_tokenizers = pytest.importorskip("vllm.tokenizers")

    vt = vllm_tokenizers.get_tokenizer(hf_dirs["qwen3_moe"])
    assert (vt.bos_token_id, vt.eos_token_id) == (BOS_ID, EOS_ID)
    for prompt, completion in task_texts(50):
        assert vt.encode(prompt) == tok.encode(prompt)
        assert vt(prompt + completion).input_ids == tok.encode(prompt + completion)
        assert vt.decode(tok.encode(completion, eos=True), skip_special_tokens=True) == completion
