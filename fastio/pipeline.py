"""The old import path of the pipelines (before 0.1): importing it is refused in one line naming where the pipeline
objects are now."""

raise ImportError("fastio.pipeline is the old spelling (GraphSpec, build_pipeline, ...); give the pipeline object: "
                  "pipeline=fastio.ImageTrain(size=224) (also fastio.ImageEval, fastio.Raw, fastio.Graph(fn), "
                  "from fastio.pipelines)")
