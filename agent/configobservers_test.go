package agent

import (
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
)

// TestConfigObservers: an observer gets the config once it is in force,
// and again only when it changes; a rejected config changes nothing.
func TestConfigObservers(t *testing.T) {
	var got []*config.Config
	h := newHarness(t, simNode(t, "dgx-h100"), func(h *harness) {
		h.opts.ConfigObservers = []func(*config.Config){func(c *config.Config) { got = append(got, c) }}
	})
	h.config("version: v1\nconfigs:\n  default:\n    usage:\n      idleEventAfter: 2h\n")
	if len(got) != 1 || got[0].Usage.IdleEventAfter.D() != 2*time.Hour {
		t.Fatalf("after the first config: %+v", got)
	}
	h.step(Tick{})
	if len(got) != 1 {
		t.Fatalf("a resync told the observers again: %d calls", len(got))
	}
	h.config("version: v1\nconfigs:\n  default:\n    usage:\n      idleEventAfter: 10s\n")
	if len(got) != 1 {
		t.Fatalf("a rejected config reached the observers: %+v", got[1:])
	}
	h.config("version: v1\nconfigs:\n  default: {}\n")
	if len(got) != 2 || got[1].Usage.IdleEventAfter != 0 {
		t.Fatalf("after the idle Event was turned off: %+v", got)
	}
}
