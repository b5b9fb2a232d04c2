"""Message sizes of the sender: a summary batch weighs its rows, not one record."""

from __future__ import annotations

from trainscope.producers.torch.sender import MAX_BATCH_RECORDS
from trainscope.schemas import summaries
from trainscope.schemas.records import StepRecord


def test_summary_batches_count_their_rows_towards_the_message_bound() -> None:
    functions = {("torch_op", f"op{i}", 0): [10, 20, 30] for i in range(1_200)}
    batches = summaries.summary_batches(functions, job_id="j", rank=0, window_start_ns=0,
                                        window_end_ns=10)
    steps = [StepRecord(job_id="j", rank=0, step=i, start_ns=i, duration_ns=1)
             for i in range(300)]
    chunks = summaries.message_chunks([*steps, *batches], MAX_BATCH_RECORDS)
    assert [sum(len(r) if r in batches else 1 for r in chunk) for chunk in chunks] == [
        300, 500, 500, 200]
    assert all(sum(len(r) if r in batches else 1 for r in c) <= MAX_BATCH_RECORDS
               for c in chunks)
    assert [r for chunk in chunks for r in chunk] == [*steps, *batches]
