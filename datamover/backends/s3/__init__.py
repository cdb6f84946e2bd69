"""s3: DRAM <-> OBJ against any S3-compatible object store (boto3), with CRC32C checksums.

- ``backend``: ``S3Backend``, its plan, and the PUT and GET of one row (the answer checked); ``run``: one post executed.
- ``bodies`` (response bodies into the caller's memory, fenced), ``client`` (boto3 clients), ``retries`` (botocore's
  retries bounded by the deadline), ``errors`` (botocore errors as typed ones), ``params``, ``checksums`` (CRC32C).
"""

from .backend import S3Backend
from .checksums import CRC_META, crc32c_b64

__all__ = ["CRC_META", "S3Backend", "crc32c_b64"]
