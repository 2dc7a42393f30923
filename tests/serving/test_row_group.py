"""RowGroup: the FINAL flag goes with a request's last row; an error closes the request once."""
from __future__ import annotations

import threading

from backend.serving.engine_model.row_group import RowGroup


def test_only_the_last_row_to_finish_carries_the_final_flag():
    g = RowGroup(3)
    assert [g.row_finished(), g.row_finished(), g.row_finished()] == [False, False, True]
    assert not g.close()  # everything was answered: an error now has nobody to go to


def test_the_first_error_ends_the_request_and_silences_the_other_rows():
    g = RowGroup(3)
    assert not g.row_finished()
    assert g.close() and g.closed
    assert not g.close()           # a second error is not sent
    assert not g.row_finished()    # nor a FINAL after the error's
    assert not g.row_finished()


def test_exactly_one_final_under_concurrent_rows():
    for _ in range(200):
        g = RowGroup(8)
        finals = []
        threads = [threading.Thread(target=lambda: finals.append(g.row_finished())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert finals.count(True) == 1
