"""What the metrics fork server imports once, so that each metrics process starts with it.

report/metric_worker.py names this module as the fork server's preload (the training process
never imports it): the metrics process's code and the transformers modules its model loading
reaches (the processing modules alone take seconds to import), so a metrics process forked
from the server starts in a fraction of a second instead of importing them again.
"""

import transformers.image_processing_utils  # noqa: F401
import transformers.modeling_utils  # noqa: F401
import transformers.processing_utils  # noqa: F401

import difftune.report.metric_process  # noqa: F401
