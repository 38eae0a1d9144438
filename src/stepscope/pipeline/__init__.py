"""Asynchronous inference→training pipelines: who starves whom (PipelineMonitor), in-process or across Ray."""

from stepscope.pipeline.monitor import NULL_PIPELINE, NullPipeline, PipelineMonitor, PipelineSnapshot

__all__ = ["NULL_PIPELINE", "NullPipeline", "PipelineMonitor", "PipelineSnapshot"]
