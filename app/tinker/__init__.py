"""The Tinker training API (the `tinker` SDK's wire protocol), served by `molt serve` under /tinker: docs/tinker.md."""
