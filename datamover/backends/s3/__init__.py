"""s3: DRAM <-> OBJ against any S3-compatible object store (boto3), with CRC32C checksums."""

from .backend import CRC_META, S3Backend, crc32c_b64

__all__ = ["CRC_META", "S3Backend", "crc32c_b64"]
