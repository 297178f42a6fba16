"""Best-of-N's pure parts on hand-computed values: step ends, the weakest step, ranking and choice;
the PRM's step scores against the Hugging Face model's own logits; the dataset writer."""
import json
import math

import pytest
import torch

from algorithms.best_of_n import StepSplitter, padded_ends, rank_candidates, weakest_step
from xray.data.records import RecordWriter

pytestmark = pytest.mark.unit
NAN = float("nan")


class CharTokenizer:
    """Token t is the character chr(t); 2 is EOS."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_step_ends_at_separators_and_the_last_token_before_eos():
    split = StepSplitter(CharTokenizer(), "\n", stop_ids=[2])
    a, nl, b = ord("a"), ord("\n"), ord("b")
    assert split.ends(3, [a, nl, b, b, 2]) == [4, 6]       # "a\n" then "bb", EOS dropped
    assert split.ends(3, [a, nl, 2]) == [4]                # ends on its separator: one step
    assert split.ends(1, [a, a]) == [2]                     # no separator, cut by length
    assert split.ends(5, [2]) == []                         # an empty response has no step
    assert padded_ends([[4, 6], [], [2]]).tolist() == [[4, 6], [-1, -1], [2, -1]]


def test_weakest_step_ignores_padding_and_scores_no_step_zero():
    steps = torch.tensor([[0.9, 0.3, NAN], [0.7, NAN, NAN], [NAN, NAN, NAN]])
    assert weakest_step(steps).tolist() == pytest.approx([0.3, 0.7, 0.0])


def test_ranking_weights_orm_over_prm_and_filters_by_thresholds():
    orm = torch.tensor([1.0, 1.0, 0.0, NAN])
    prm = torch.tensor([0.2, 0.9, 0.95, 1.0])
    r = rank_candidates(orm, prm, orm_weight=10.0, orm_threshold=0.5, prm_threshold=0.5)
    assert r.score.tolist()[:3] == pytest.approx([10.2, 10.9, 0.95]) and r.score[3] == -math.inf
    assert r.passed.tolist() == [False, True, False, False]  # 0: weak step; 2: wrong; 3: no score
    assert r.order == [1, 0, 2, 3]
    assert r.best(2) == [(1, 2)]                            # only one passed; rejected: the worst scored one
    loose = rank_candidates(orm, prm, orm_weight=10.0)
    assert loose.passed.tolist() == [True, True, True, False]
    assert loose.best(2) == [(1, 2), (0, 2)]


def test_ties_keep_the_earlier_candidate_and_equal_worst_is_no_rejected():
    r = rank_candidates(torch.tensor([1.0, 1.0, 1.0]), None, orm_weight=10.0)
    assert r.order == [0, 1, 2]
    assert r.best(1) == [(0, None)]                         # all equally good: no pair to learn from
    prm_only = rank_candidates(None, torch.tensor([0.1, 0.8]), orm_weight=10.0, prm_threshold=0.5)
    assert prm_only.best(1) == [(1, 0)] and prm_only.passed.tolist() == [False, True]


def test_prm_step_scores_match_the_hf_model_logits(tmp_path, tiny_model):
    from transformers import AutoModelForSequenceClassification

    from xray.config.parallel import ParallelDims
    from xray.data.batch import Batch
    from xray.workhorse.reward import STEP_ENDS, RewardWorkhorse

    torch.manual_seed(0)
    prm_dir = tmp_path / "prm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, pad_token_id=0).save_pretrained(prm_dir)
    ids = torch.tensor([[1, 9, 8, 7, 6, 5], [1, 4, 4, 0, 0, 0]])
    attn = (ids != 0).long()
    ends = torch.tensor([[2, 5], [2, -1]])
    worker = RewardWorkhorse("prm", 0, ParallelDims(), model_dir=str(prm_dir), steps=True)
    worker.setup()
    got = worker.score_steps(Batch({"input_ids": ids, "attention_mask": attn, STEP_ENDS: ends}))
    hf = AutoModelForSequenceClassification.from_pretrained(prm_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # the prefix up to each step end, scored as a whole sequence by transformers
        want = [[torch.sigmoid(hf(input_ids=ids[b:b + 1, :e + 1]).logits[0, 0]).item() for e in row if e >= 0]
                for b, row in enumerate(ends.tolist())]
    assert got[0].tolist() == pytest.approx(want[0], abs=1e-5)
    assert got[1, 0].item() == pytest.approx(want[1][0], abs=1e-5) and math.isnan(got[1, 1].item())
    assert len({round(x, 6) for x in got[0].tolist()}) == 2  # the two prefixes score differently


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_record_writer_round_trips_and_names_the_file_only_when_done(tmp_path, name):
    from xray.data.files import read_rows

    writer = RecordWriter(tmp_path / name)
    writer.write([{"prompt": "1+1=", "response": "2", "score": 10.0, "prm_steps": [0.5, 0.25]}])
    writer.write([{"prompt": "2+2=", "response": "5", "score": -math.inf, "prm_steps": []}])
    assert not (tmp_path / name).exists()
    path = writer.close()
    rows, _ = read_rows(path)
    assert [r["response"] for r in rows] == ["2", "5"]
    assert rows[0]["prm_steps"] == [0.5, 0.25] and rows[1]["score"] is None  # -inf is not JSON
    if name.endswith(".jsonl"):
        assert json.loads(path.read_text().splitlines()[0])["score"] == 10.0
