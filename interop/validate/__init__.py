"""Cross-validation tooling above both backends (imports them lazily): the command line, the
cross-check, ahead-of-time compile checks, capture/replay and the upstream peer loader."""
