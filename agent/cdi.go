package agent

import (
	"os"

	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// CDISpecs keeps the node's CDI spec and the specs of DRA claims that need
// their own (cdi.Keeper).
type CDISpecs interface {
	// Sync writes the spec of inv when want is set, removes it otherwise,
	// and says whether the file changed and how many devices it names.
	Sync(inv *gpu.Inventory, want bool) (changed bool, devices int, err error)
	Path() string
	WriteClaim(uid string, devs []cdi.ClaimDevice) error
	ClaimPath(uid string) string
	RemoveClaim(uid string) error
	RemoveStaleClaims(keep func(uid string) bool) ([]string, error)
}

// CDIStatus is the CDI spec's state on /status.
type CDIStatus struct {
	// Spec is the spec file ("" while no spec is needed).
	Spec    string `json:"spec,omitempty"`
	Devices int    `json:"devices,omitempty"`
	Error   string `json:"error,omitempty"`
}

// cdiWanted says whether containers may be given CDI device names: the DRA
// driver always answers with them, the device plugin when the config in
// force has a CDI device list strategy.
func (a *Agent) cdiWanted() bool {
	if a.opts.DRA != nil {
		return true
	}
	return a.cdiPlugin
}

// syncCDI brings the CDI spec in step with the inventory before anything
// hands out a CDI name for it: a runtime that finds no such device fails
// the container.
func (a *Agent) syncCDI(why string) {
	if a.opts.CDI == nil || a.inv == nil {
		return
	}
	// Once written, the spec is kept (and kept current) even when nothing
	// hands out CDI names any more: a container given one earlier resolves
	// it again whenever it restarts, and would fail without it.
	_, statErr := os.Stat(a.opts.CDI.Path())
	written := statErr == nil
	want := a.cdiWanted() || written
	changed, n, err := a.opts.CDI.Sync(a.inv, want)
	prev := a.cdiStatus
	a.cdiStatus = CDIStatus{}
	if want && n > 0 {
		a.cdiStatus = CDIStatus{Spec: a.opts.CDI.Path(), Devices: n}
	}
	if err != nil {
		// What could be described may still have been written (a MIG device
		// without its capability nodes is left out): the error says what not.
		a.cdiStatus.Error = err.Error()
		if prev.Error != err.Error() {
			a.log.Error("CDI spec incomplete or not written: containers given the devices it lacks will fail to start",
				"spec", a.opts.CDI.Path(), "reason", why, "error", err)
			a.event(true, ReasonCDISpecFailed, "CDI spec %s: %v", a.opts.CDI.Path(), err)
		}
	} else if prev.Error != "" {
		a.log.Info("CDI spec complete again", "spec", a.opts.CDI.Path())
	}
	if changed {
		a.log.Info("CDI spec written", "spec", a.opts.CDI.Path(), "devices", n, "reason", why)
	}
}
