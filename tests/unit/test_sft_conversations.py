"""SFT on conversations (`xray.data.conversation`, `algorithms.sft.supervised_pairs`) with the real
SmolLM2 tokenizer and its ChatML template: only the assistant turns and the `<|im_end|>` closing each
are trained; TRL's conversational prompt/completion trains the completion; plain rows are as before."""
import pytest

from xray.config.data import DataConfig
from xray.data import columns as C
from xray.data.conversation import ConversationError, conversation_pairs
from xray.data.files import Rows
from xray.data.sequences import pack_sequences

pytestmark = pytest.mark.unit

CHAT = [{"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."}]


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def rows(*dicts) -> Rows:
    return Rows(list(dicts), [f"c.jsonl:{i + 1}" for i in range(len(dicts))], "c.jsonl")


def trained(tok, triple) -> tuple[str, str, list[int]]:
    """(decoded trained tokens, decoded whole sequence, trained token ids) of one packed row."""
    batch = pack_sequences([triple[0]], [triple[1]], tok.pad_token_id, response_masks=[triple[2]])
    ids, mask = batch[C.INPUT_IDS][0], batch[C.LOSS_MASK][0]
    picked = ids[1:][mask.bool()].tolist()                    # position t scores token t+1
    return tok.decode(picked), tok.decode(triple[0] + triple[1]), picked


def test_messages_train_the_assistant_turns_and_their_ends_only(tok):
    (triple,) = conversation_pairs(rows({"messages": CHAT, "source": "x"}), tok, DataConfig())
    text, whole, picked = trained(tok, triple)
    assert text == "Hello! How can I help?<|im_end|>2+2 is 4.<|im_end|>"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end == tok.eos_token_id == 2
    want = [t for m in CHAT if m["role"] == "assistant" for t in tok(m["content"]).input_ids + [end]]
    assert picked == want                                   # exactly these tokens, nothing else
    # the prompt is the rendered context up to the first assistant header; the response ends at the last <|im_end|>
    assert tok.decode(triple[0]).endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(triple[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert whole + "\n" == tok.apply_chat_template(CHAT, tokenize=False)
    assert len(triple[2]) == len(triple[1]) and sum(triple[2]) == len(want)


def test_conversational_prompt_completion_trains_the_completion(tok):
    row = {"prompt": CHAT[:3], "completion": [{"role": "assistant", "content": "It is 4."}]}
    (triple,) = conversation_pairs(rows(row), tok, DataConfig(answer_field="completion"))
    text, whole, _ = trained(tok, triple)
    assert text == "It is 4.<|im_end|>"                     # the prompt's own assistant turn is context
    assert "Hello! How can I help?" in tok.decode(triple[0])
    string_prompt = {"prompt": "What is 2+2?", "completion": [{"role": "assistant", "content": "4"}]}
    (triple,) = conversation_pairs(rows(string_prompt), tok, DataConfig(answer_field="completion"))
    assert trained(tok, triple)[0] == "4<|im_end|>"
    assert tok.decode(triple[0]).endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_plain_rows_are_trained_as_before(tok):
    from algorithms.sft import answer_pairs, supervised_pairs
    from xray.data.prompts import load_prompts

    plain = rows({"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"})
    assert conversation_pairs(plain, tok, DataConfig()) is None
    pairs = supervised_pairs(plain, DataConfig(max_prompt_tokens=64), tok)
    prompts = load_prompts(plain, tok, max_prompt_tokens=64)
    assert pairs == answer_pairs(prompts.prompt_ids, ["4", "6"], tok)
    assert pairs[0][1] == tok("4", add_special_tokens=False).input_ids + [tok.eos_token_id]


def test_conversation_errors_name_the_row(tok, tmp_path):
    with pytest.raises(ConversationError, match=r"c\.jsonl:2: a plain \(prompt, answer\) row among conversations"):
        conversation_pairs(rows({"messages": CHAT}, {"prompt": "a", "answer": "b"}), tok, DataConfig())
    with pytest.raises(ConversationError, match=r"c\.jsonl:1: no assistant message to train on"):
        conversation_pairs(rows({"messages": CHAT[:1]}), tok, DataConfig())
    with pytest.raises(ConversationError, match=r"c\.jsonl:1: 'messages' is a str, not a list"):
        conversation_pairs(rows({"messages": "hi"}), tok, DataConfig())
    # a template that rewrites past assistant turns breaks the prefix property: refused
    rewriting = tmp_path / "rewrite.jinja"
    rewriting.write_text("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                         "<|im_start|>assistant\n[earlier]<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ConversationError, match=r"c\.jsonl:1: .*message 1.*rewrites earlier turns"):
        conversation_pairs(rows({"messages": CHAT}), tok, DataConfig(chat_template=str(rewriting)))
    # the same template keeps a one-turn conversation's prefixes: accepted
    (triple,) = conversation_pairs(rows({"messages": CHAT[:2]}), tok, DataConfig(chat_template=str(rewriting)))
    assert trained(tok, triple)[0] == "Hello! How can I help?<|im_end|>"
