"""The checkpoint format: a laid-out checkpoint's manifest reads back; damage is refused."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.persist import manifest as fmt

# Names without escapes in JSON: a case change inside "\u00e9" would not change the value.
NAME = st.text("abcxyz019_-", min_size=1, max_size=8)
entries = st.dictionaries(NAME, st.binary(max_size=32), max_size=6)
metadata = st.dictionaries(NAME, st.integers() | NAME, max_size=4)


@given(sequence=st.integers(1, 10**8), entries=entries, metadata=metadata)
def test_a_laid_out_checkpoint_reads_back_with_every_entry_listed(sequence, entries, metadata):
    label = fmt.label_of(sequence)
    files, digest = fmt.layout(label, entries, job_id="job", metadata=metadata, created=1.5)
    manifest = fmt.parse_manifest(label, files[fmt.MANIFEST])
    assert list(files)[-1] == fmt.MANIFEST  # written last: a manifest means the entries are there
    assert manifest["digest"] == digest and manifest["metadata"] == metadata
    assert fmt.sequence_of(label) == manifest["sequence"] == sequence
    for name, data in entries.items():
        record = manifest["entries"][name]
        assert files[record["file"]] == data
        assert record["size"] == len(data)
        assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert len(files) == len(entries) + 1


@given(entries=entries, position=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_a_manifest_with_any_byte_changed_is_unusable_or_means_the_same(entries, position, flip):
    files, _ = fmt.layout("ckpt-000003", entries, job_id=None, metadata={}, created=0.0)
    raw = bytearray(files[fmt.MANIFEST])
    raw[position % len(raw)] ^= flip
    try:
        damaged = fmt.parse_manifest("ckpt-000003", bytes(raw))
    except fmt.Unusable:
        return
    # The digest covers the parsed value: "0.0" spelt "0e0" is the same manifest.
    assert damaged == fmt.parse_manifest("ckpt-000003", files[fmt.MANIFEST])


def test_a_manifest_read_under_another_label_is_unusable():
    files, _ = fmt.layout("ckpt-000003", {}, job_id=None, metadata={}, created=0.0)
    with pytest.raises(fmt.Unusable, match="checkpoint 'ckpt-000003', not 'ckpt-000004'"):
        fmt.parse_manifest("ckpt-000004", files[fmt.MANIFEST])


@pytest.mark.parametrize("label", ["ckpt-12", "ckpt-00001a", "x-000001", 7, None])
def test_a_malformed_label_is_refused_naming_it(label):
    with pytest.raises(ValueError, match=f"label must look like 'ckpt-000012', got {label!r}"):
        fmt.check_label(label)
