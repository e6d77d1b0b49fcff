package agent

import (
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/plugin"
)

// Admit is the device plugin's Admit (plugin.Options.Admit) through l: the
// plugin's hand-outs in the ledger's terms. Allocate is on the kubelet's
// container start path, so the common request (a few devices) is
// converted without an allocation.
func Admit(l *ledger.Ledger) func(resource string, devs []plugin.Handout) error {
	return func(resource string, devs []plugin.Handout) error {
		var buf [8]ledger.Handout
		hs := buf[:0]
		for _, d := range devs {
			hs = append(hs, ledger.Handout{UUID: d.UUID, Replica: d.Replica})
		}
		return l.Admit(resource, hs)
	}
}
