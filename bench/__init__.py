"""The benchmarks: one script each (`python bench/<script>.py --help`), their helpers in `_`-named
modules beside them, imported as `bench._name` whichever way a script is started."""
