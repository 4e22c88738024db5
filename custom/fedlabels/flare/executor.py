"""The site's side of a production job that carries configuration only (nvflare ``Executor``).

A production job (``job.py --prod`` / ``--poc``) has no custom folder: no client script,
no bundle copy, no ``$`` expressions of its own. Its ``config_fed_client.json`` names this
class, installed at every hospital with the pinned ``fedlabels`` release, and passes the
run configuration (``fedlabels.config.RunConfig``) as its ``config`` argument. The network
and transforms come from the installed bundles. A hospital can therefore refuse every job
that carries code (``fedlabels provision --no-byoc``) and still run ours. Each task goes to
the same ``SiteSession`` the client script runs (``fedlabels.flare.client``).
"""

from __future__ import annotations

from pathlib import Path

from nvflare.apis.executor import Executor
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from .gate import site_gate


class SiteExecutor(Executor):
    def __init__(self, config: dict):
        """
        Args:
            config: the run configuration (``RunConfig.to_json``), checked at the site before round 0: first
                by the site's gate (``fedlabels.flare.gate``), then as every run configuration is. The data
                is the site's own (``FEDLABELS_DATA``): no job chooses it.
        """
        super().__init__()
        self.config = config
        self.session = None

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if self.session is None:
            # the site's job process, before its first import of MONAI (fedlabels.flare.lean); the job writer
            # that builds this executor imports nothing of the training stack
            from .lean import skip_unused_imports

            skip_unused_imports()
            from .client import SiteSession, build_parser

            app = Path(fl_ctx.get_engine().get_workspace().get_app_dir(fl_ctx.get_job_id()))
            site = fl_ctx.get_identity_name()
            # "custom" is where a job's own bundle would be; ../config holds the job's filters
            # its lines go to the site's job log, as the client script's printed lines do
            self.session = SiteSession(site, self.config, build_parser().parse_args([]), here=app / "custom",
                                       say=self.logger.info, gate=gate_policy(site, app / "custom"))
        reply = self.session.handle(task_name, FLModelUtils.from_shareable(shareable))
        if reply.params is not None and reply.params_type is None:
            reply.params_type = ParamsType.FULL
        return FLModelUtils.to_shareable(reply)


def gate_policy(site: str, here: Path) -> dict:
    """The gate's arguments for ``SiteSession``: the kit's own (``local/resources.json``), else the defaults
    (no fault drills): a configuration-only job is gated at every site, whatever its kit holds."""
    own = site_gate(here)
    return {"site": site, "fault_drills": own.get("fault_drills") is True}
