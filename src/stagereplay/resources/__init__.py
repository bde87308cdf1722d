"""What the library reads at run time, shipped in the package (importlib.resources finds it, in a
checkout or an installed copy): the config schema (``config.schema.yaml``, the workflow's own file,
which this one links to in a checkout) and the published model shapes (``model_configs/``)."""
