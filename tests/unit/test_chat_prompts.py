"""Prompt encoding under the user's chat settings (`xray/data/chat.py`) with the real SmolLM2 tokenizer
(ChatML, a default system line), long prompts filtered and counted, and what ends a response
(`xray/data/stops.py`: EOS ids of tokenizer + generation_config.json, stop strings) as the run hands
it to the engines."""
import json
import logging
from types import SimpleNamespace

import pytest

from xray.config.data import DataConfig
from xray.config.schema import RolloutConfig, RunConfig
from xray.config.typed import ConfigError, build
from xray.data.chat import ChatFormat, ChatTemplateError, PromptRenderer
from xray.data.prompts import PromptDataError, PromptSampler, load_prompts
from xray.data.stops import stop_string_end, stop_token_ids, text_decoder
from xray.data.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.unit

CHAR = build_char_tokenizer()
USER = [{"role": "user", "content": "2+2="}]
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_template_none_is_plain_auto_is_the_tokenizers(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2="}])
    plain = load_prompts(path, tok, chat=ChatFormat("none"), max_prompt_tokens=512)
    assert plain.prompt_ids == [[34, 27, 34, 45]] == [tok("2+2=").input_ids]  # no BOS, no template
    auto = load_prompts(path, tok, max_prompt_tokens=512)
    text = tok.decode(auto.prompt_ids[0])
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert auto.prompt_ids[0][0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert auto.prompt_ids[0] == tok.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
    with pytest.raises(PromptDataError, match=r"p\.jsonl:1: the prompt is a list .*no chat template is in use"):
        load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": USER}]), tok, chat=ChatFormat("none"))


def test_system_prompt_replaces_the_default_line_unless_the_prompt_has_one(tok):
    r = PromptRenderer(tok, ChatFormat(system_prompt="You add numbers."))
    assert tok.decode(r.ids("2+2=")) == ("<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n2+2="
                                        "<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}] + USER
    assert r.text(own).startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "You add" not in r.text(own)
    with pytest.raises(ChatTemplateError, match="data.system_prompt need a chat template.*is none"):
        PromptRenderer(tok, ChatFormat("none", system_prompt="x"))
    with pytest.raises(ChatTemplateError, match="is auto and the tokenizer has no template"):
        PromptRenderer(CHAR, ChatFormat(system_prompt="x"))


def test_kwargs_reach_a_template_file(tok, tmp_path):
    jinja = tmp_path / "think.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}[assistant]{% if enable_thinking %}<think>{% endif %}{% endif %}")
    on = PromptRenderer(tok, ChatFormat(str(jinja), {"enable_thinking": True}))
    off = PromptRenderer(tok, ChatFormat(str(jinja), {"enable_thinking": False}))
    assert on.text("hi") == "[user]hi[assistant]<think>" and off.text("hi") == "[user]hi[assistant]"
    assert on.ids("hi") == tok("[user]hi[assistant]<think>", add_special_tokens=False).input_ids
    with pytest.raises(ChatTemplateError, match="not a file"):
        PromptRenderer(tok, ChatFormat(str(tmp_path / "missing.jinja")))
    with pytest.raises(ChatTemplateError, match=r"\['add_generation_prompt'\], which xray sets itself"):
        PromptRenderer(tok, ChatFormat(kwargs={"add_generation_prompt": False}))
    with pytest.raises(ChatTemplateError, match="data.chat_template_kwargs need a chat template"):
        PromptRenderer(CHAR, ChatFormat(kwargs={"enable_thinking": True}))


def test_message_lists_from_parquet_and_jsonl_match_apply_chat_template(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    conversations = [[{"role": "system", "content": "Solve it."}, {"role": "user", "content": "3+4="}],
                     [{"role": "user", "content": "What is 6*7?"}]]
    verl = [{"prompt": c, "data_source": "math", "reward_model": {"ground_truth": a}}
            for c, a in zip(conversations, ["7", "42"])]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "verl.parquet")
    trl = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": c, "solution": a} for c, a in zip(conversations, ["7", "42"])])
    expected = [tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in conversations]
    from_parquet = load_prompts(tmp_path / "verl.parquet", tok, max_prompt_tokens=512)
    from_jsonl = load_prompts(trl, tok, max_prompt_tokens=512)
    assert from_parquet.prompt_ids == expected == from_jsonl.prompt_ids
    assert from_parquet.prompts == conversations and from_parquet.extras["reward_model"][1] == {"ground_truth": "42"}
    assert tok.decode(expected[0]).startswith("<|im_start|>system\nSolve it.<|im_end|>")  # its own system line
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:1: message 0 of the prompt is 'hi'"):
        load_prompts(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ["hi"]}]), tok)


def test_filter_drops_exactly_the_long_rows_and_counts_them(tmp_path, caplog):
    from xray.run.inputs import RunData

    rows = [{"prompt": "1+1=", "n": 0}, {"prompt": "123456+7=", "n": 1}, {"prompt": "2+2=", "n": 2},
            {"prompt": "99999+1=", "n": 3}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="xray.data.prompts"):
        ps = load_prompts(path, CHAR, max_prompt_tokens=5)  # the default rule: filter
    assert DataConfig().on_long_prompt == "filter"
    assert ps.prompts == ["1+1=", "2+2="] and ps.extras["n"] == [0, 2] and ps.dropped == 2 and ps.truncated == 0
    assert ps.prompt_ids == [[1, 5, 41, 5, 45], [1, 6, 41, 6, 45]] and ps.where[1].endswith("p.jsonl:3")
    assert "2 of 4 prompts" in caplog.text and "data.max_prompt_tokens=5" in caplog.text
    assert ps.select([1, 1]).dropped == 2
    held = load_prompts(path, CHAR, max_prompt_tokens=9, on_long_prompt="truncate")
    facts = RunData("dir", CHAR, ps, held, PromptSampler(2, 1, 0), None).facts
    assert facts == {"data/train_prompts": 2, "data/eval_prompts": 4, "data/long_prompts_dropped": 2,
                     "data/long_prompts_truncated": 1}
    with pytest.raises(PromptDataError, match="every prompt .* longer than data.max_prompt_tokens=2"):
        load_prompts(path, CHAR, max_prompt_tokens=2)
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: the prompt has 10 tokens.*set data.on_long_prompt to filter"):
        load_prompts(path, CHAR, max_prompt_tokens=5, on_long_prompt="reject")
    with pytest.raises(PromptDataError, match="use one of filter, truncate, reject"):
        load_prompts(path, CHAR, on_long_prompt="cut")


def test_chat_settings_are_typed_config():
    cfg = build(DataConfig, {"chat_template": "none", "chat_template_kwargs": {"enable_thinking": False},
                             "system_prompt": "Be exact.", "on_long_prompt": "truncate"}, "data")
    assert ChatFormat.of(cfg) == ChatFormat("none", {"enable_thinking": False}, "Be exact.")
    with pytest.raises(ConfigError, match="data.on_long_prompt: must be one of 'filter', 'truncate', 'reject'"):
        build(DataConfig, {"on_long_prompt": "drop"}, "data")
    with pytest.raises(ConfigError, match="rollout.stop"):
        build(RolloutConfig, {"stop": "</tool>"}, "rollout")


def test_stop_ids_from_tokenizer_and_generation_config(tok, tmp_path):
    assert stop_token_ids(tok) == [2]  # SmolLM2's directory (the tokenizer's) says eos 2 too
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert stop_token_ids(tok, tmp_path) == [2, 7, 9]
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_token_ids(tok, tmp_path) == [2, 5]  # without generation_config.json: config.json's
    assert stop_token_ids(CHAR) == [2]


def test_stop_strings_end_at_the_token_that_completes_the_first(tok):
    ids = tok("The answer is 42.\n\nDone. More text").input_ids  # ... '.', '\n', '\n', 'Done', '.', ' More' ...
    decode = text_decoder(tok)
    assert stop_string_end(decode, ids, ["\n\n"]) == 9
    assert stop_string_end(decode, ids, [" More", "\n\nDo"]) == 10  # completed inside 'Done': the token is kept
    assert decode(ids[:10]).endswith("\n\nDone")
    assert stop_string_end(decode, ids, ["zzz"]) is None and stop_string_end(decode, ids, []) is None


def test_the_run_passes_stops_to_the_engines():
    from xray.backends.sampling import SamplingError, SamplingSpec
    from xray.run.models import role_init_kwargs
    from xray.run.phases import rollout_sampling

    cfg = RunConfig(rollout=RolloutConfig(stop=["</answer>"]))
    sampling = rollout_sampling(cfg, [2, 7], step=3)
    assert sampling["stop"] == ["</answer>"] and sampling["stop_token_ids"] == [2, 7]
    assert "stop" not in rollout_sampling(SimpleNamespace(rollout=RolloutConfig(), seed=1), [2], 1)
    spec = SamplingSpec.from_dict(sampling)
    assert spec.stop == ("</answer>",) and spec.stop_token_ids == (2, 7)
    assert SamplingSpec.from_dict({"stop": "\n"}).stop == ("\n",)
    with pytest.raises(SamplingError, match="non-empty strings"):
        SamplingSpec.from_dict({"stop": ["ok", ""]})
    assert role_init_kwargs(cfg, "rollout", "vllm", "/m")["stop_strings"] is True
    assert "stop_strings" not in role_init_kwargs(RunConfig(), "rollout", "dsinfer", "/m")
