"""The closing table says "personal accuracy" only for methods whose clients have models of their own."""

from fedpartial._src.cli.progress import held_out_rows

SUMMARY = {"final_personal_accuracy": 0.8, "final_personal_accuracy_std": 0.05, "final_global_client_accuracy": 0.7,
           "personal_state_bytes": 2**20}


def test_personal_accuracy_only_with_personal_models():
    own = dict(held_out_rows(SUMMARY, personal=True))
    assert own["personal accuracy (mean ± std over clients)"] == "0.8000 ± 0.0500" and "personal state" in own
    shared = held_out_rows(SUMMARY, personal=False)
    assert shared == [("global model on clients' held-out data (mean ± std over clients)", "0.8000 ± 0.0500")]
    assert not any("personal" in label for label, _ in shared)
    assert held_out_rows({}, personal=True) == []
