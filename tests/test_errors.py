"""datamover.errors: every error pickles (it crosses processes) with its class, message and fields intact."""

import pickle

import pytest

from datamover.errors import (
    ConfigError,
    CudaError,
    InvalidParameter,
    NotRegistered,
    ObjectStoreError,
    TransferIOError,
    UcpError,
)

FIELDS = ("reason", "index", "backend", "errno", "cuda_error", "bucket", "key", "status", "code", "path")


@pytest.mark.parametrize(
    "err",
    [
        TransferIOError("x", errno=5, index=2, backend="posix"),
        CudaError("c", cuda_error="cudaErrorInvalidValue", index=1),
        ObjectStoreError("s", bucket="b", key="k", status=404, code="NoSuchKey", errno=2, index=3, backend="s3"),
        UcpError("u", status=-3),
        ConfigError("tiers.l2", "capacity must be positive"),
        InvalidParameter("unknown parameter(s) ['x']", backend="gds"),
        NotRegistered("outside", index=4),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_fields(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    for name in FIELDS:
        assert getattr(back, name, None) == getattr(err, name, None), name


def test_shown_quotes_values_short_without_building_their_whole_repr():
    from datamover.errors import shown

    assert shown("4K") == "'4K'" and shown(4.5) == "4.5" and shown(None) == "None"
    nested: list = ["x"] * 9
    for _ in range(9):  # 9**10 leaves through shared references: repr() would not finish
        nested = [nested] * 9
    assert len(shown(nested)) <= 120 and shown(nested).startswith("[[")
    assert len(shown("y" * 10**6)) <= 120 and len(shown(10**5000)) <= 120
