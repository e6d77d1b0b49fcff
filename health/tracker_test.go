package health

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
)

// testInventory: GPU-0 in MIG mode with GI 1, 2 (CI 0 and 1 on GI 2), GPU-1 whole.
func testInventory() *gpu.Inventory {
	return &gpu.Inventory{GPUs: []gpu.GPU{
		{Index: 0, UUID: "GPU-0", MIG: gpu.MIGMode{Current: true}, Instances: []gpu.MIGInstance{
			{UUID: "MIG-1-0", GI: 1, CI: 0},
			{UUID: "MIG-2-0", GI: 2, CI: 0},
			{UUID: "MIG-2-1", GI: 2, CI: 1},
		}},
		{Index: 1, UUID: "GPU-1"},
	}}
}

var allIDs = []string{"GPU-0", "GPU-0::1", "MIG-1-0", "MIG-1-0::3", "MIG-2-0", "MIG-2-1", "MIG-2-1::0", "GPU-1", "GPU-1::2"}

func newTestTracker(p Policy) *tracker {
	tr := newTracker(p, slog.New(slog.DiscardHandler))
	tr.setInventory(testInventory())
	return tr
}

// badSet lists which of allIDs the state calls unhealthy.
func badSet(s *State) []string {
	var out []string
	for _, id := range allIDs {
		if _, bad := s.Unhealthy(id); bad {
			out = append(out, id)
		}
	}
	return out
}

func TestPolicyFatal(t *testing.T) {
	tests := []struct {
		name string
		cfg  config.Health
		xid  uint64
		want bool
	}{
		{"default ignored app error", config.Health{}, 13, false},
		{"default ignored 109", config.Health{}, 109, false},
		{"double-bit ECC", config.Health{}, 48, true},
		{"unknown xid is fatal", config.Health{}, 999, true},
		{"user ignores", config.Health{IgnoredXids: []int{94}}, 94, false},
		{"user makes default-ignored fatal", config.Health{FatalXids: []int{13}}, 13, true},
		{"defaults disabled", config.Health{DisableDefaultIgnored: true}, 43, true},
		{"defaults disabled, user list kept", config.Health{DisableDefaultIgnored: true, IgnoredXids: []int{43}}, 43, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := PolicyFromConfig(tt.cfg).Fatal(tt.xid); got != tt.want {
				t.Errorf("Fatal(%d) = %v, want %v", tt.xid, got, tt.want)
			}
		})
	}
	p := PolicyFromConfig(config.Health{})
	if p.QuietPeriod != config.DefaultRecoveryQuietPeriod || p.ProbeInterval != config.DefaultProbeInterval {
		t.Errorf("defaults: quiet %v probe %v", p.QuietPeriod, p.ProbeInterval)
	}
}

func TestXIDClass(t *testing.T) {
	tests := []struct {
		xid  uint64
		want Class
	}{{13, ClassApp}, {94, ClassApp}, {48, ClassReset}, {74, ClassReset}, {95, ClassReset}, {79, ClassReboot}, {9999, ClassReset}}
	for _, tt := range tests {
		if got, _ := XIDClass(tt.xid); got != tt.want {
			t.Errorf("XIDClass(%d) = %v, want %v", tt.xid, got, tt.want)
		}
	}
}

func TestEventMarksDevicesAndSiblings(t *testing.T) {
	tests := []struct {
		name  string
		apply func(tr *tracker, now time.Time)
		want  []string
	}{
		{"GPU-wide XID marks GPU, every MIG device and every replica", func(tr *tracker, now time.Time) {
			tr.xid("GPU-0", 48, AllInstances, AllInstances, now)
		}, []string{"GPU-0", "GPU-0::1", "MIG-1-0", "MIG-1-0::3", "MIG-2-0", "MIG-2-1", "MIG-2-1::0"}},
		{"GI-scoped XID marks that GI's MIG devices only", func(tr *tracker, now time.Time) {
			tr.xid("GPU-0", 48, 2, AllInstances, now)
		}, []string{"MIG-2-0", "MIG-2-1", "MIG-2-1::0"}},
		{"GI+CI-scoped XID marks one MIG device and its replicas", func(tr *tracker, now time.Time) {
			tr.xid("GPU-0", 48, 2, 1, now)
		}, []string{"MIG-2-1", "MIG-2-1::0"}},
		{"one failing GPU never marks another", func(tr *tracker, now time.Time) {
			tr.xid("GPU-1", 79, AllInstances, AllInstances, now)
		}, []string{"GPU-1", "GPU-1::2"}},
		{"default-ignored XID marks nothing", func(tr *tracker, now time.Time) {
			tr.xid("GPU-1", 13, AllInstances, AllInstances, now)
			tr.xid("GPU-0", 43, 1, 0, now)
		}, nil},
		{"double-bit ECC marks", func(tr *tracker, now time.Time) {
			tr.ecc("GPU-1", true, AllInstances, AllInstances, now)
		}, []string{"GPU-1", "GPU-1::2"}},
		{"single-bit ECC only counts", func(tr *tracker, now time.Time) {
			tr.ecc("GPU-1", false, AllInstances, AllInstances, now)
		}, nil},
		{"event for an unknown GPU is dropped", func(tr *tracker, now time.Time) {
			tr.xid("GPU-9", 48, AllInstances, AllInstances, now)
		}, nil},
		{"lost probe marks the whole GPU", func(tr *tracker, now time.Time) {
			tr.probe("GPU-0", probeResult{reach: reachLost}, now)
		}, []string{"GPU-0", "GPU-0::1", "MIG-1-0", "MIG-1-0::3", "MIG-2-0", "MIG-2-1", "MIG-2-1::0"}},
		{"inconclusive probe marks nothing", func(tr *tracker, now time.Time) {
			tr.probe("GPU-0", probeResult{reach: reachUnknown}, now)
		}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := newTestTracker(Policy{})
			tt.apply(tr, simtest.NewClock().Now())
			got := badSet(tr.state())
			if strings.Join(got, ",") != strings.Join(tt.want, ",") {
				t.Errorf("unhealthy = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestEventStatsAndReasons(t *testing.T) {
	tr := newTestTracker(Policy{})
	now := simtest.NewClock().Now()
	tr.xid("GPU-1", 13, AllInstances, AllInstances, now)
	tr.xid("GPU-1", 48, AllInstances, AllInstances, now)
	tr.xid("GPU-1", 48, AllInstances, AllInstances, now.Add(time.Second))
	tr.ecc("GPU-1", false, AllInstances, AllInstances, now)
	s := tr.state()
	st, _ := s.Stats("GPU-1")
	if st.LastXID != 48 || st.XIDs[48] != 2 || st.XIDs[13] != 1 || st.SingleBitEvents != 1 {
		t.Errorf("stats = %+v", st)
	}
	if len(s.Causes) != 1 || s.Causes[0].Count != 2 || !s.Causes[0].Last.Equal(now.Add(time.Second)) {
		t.Fatalf("repeated XID must merge into one cause: %+v", s.Causes)
	}
	reason, _ := s.Unhealthy("GPU-1::0")
	if !strings.Contains(reason, "XID 48") || !strings.Contains(reason, "reset-gpu") {
		t.Errorf("reason %q lacks the XID and class", reason)
	}
	if got := s.UnhealthyDevices(); len(got) != 1 || got["GPU-1"] == "" {
		t.Errorf("UnhealthyDevices = %v", got)
	}
	var ignored bool
	for _, e := range s.Log {
		ignored = ignored || (e.Action == ActionIgnored && strings.Contains(e.Message, "XID 13"))
	}
	if !ignored {
		t.Errorf("the log does not say XID 13 was ignored: %+v", s.Log)
	}
}

func TestRecovery(t *testing.T) {
	const quiet = 5 * time.Minute
	gpuWide := AllInstances
	tests := []struct {
		name string
		// steps run in order; each gets the clock.
		steps []func(tr *tracker, c *simtest.Clock)
		// bad after all steps, and the text a log entry must contain.
		wantBad bool
		wantLog string
	}{
		{
			name: "app class recovers after the quiet period",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 94, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { c.Add(quiet); tr.tick(c.Now()) },
			},
			wantLog: "no recurrence for 5m0s",
		},
		{
			name: "app class recurrence restarts the quiet period",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 94, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { c.Add(quiet - time.Second); tr.tick(c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 94, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { c.Add(quiet - time.Second); tr.tick(c.Now()) },
			},
			wantBad: true, wantLog: "XID 94",
		},
		{
			name: "reset class ignores the quiet period",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 48, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { c.Add(24 * time.Hour); tr.tick(c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.probe("GPU-1", probeResult{reach: reachOK}, c.Now()) },
			},
			wantBad: true, wantLog: "XID 48",
		},
		{
			name: "reset class recovers when volatile ECC counts clear",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 48, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) {
					tr.probe("GPU-1", probeResult{reach: reachOK, dbeVolatile: 2, dbeKnown: true}, c.Now())
				},
				func(tr *tracker, c *simtest.Clock) {
					tr.probe("GPU-1", probeResult{reach: reachOK, dbeVolatile: 0, dbeKnown: true}, c.Now())
				},
			},
			wantLog: "volatile double-bit ECC count dropped from 2 to 0",
		},
		{
			name: "reset class recovers when NVML's recovery action clears",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.ecc("GPU-1", true, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) {
					tr.probe("GPU-1", probeResult{reach: reachOK, action: 0, actionKnown: true}, c.Now())
				},
				func(tr *tracker, c *simtest.Clock) {
					tr.probe("GPU-1", probeResult{reach: reachOK, action: 1, actionKnown: true}, c.Now())
				},
				func(tr *tracker, c *simtest.Clock) {
					tr.probe("GPU-1", probeResult{reach: reachOK, action: 0, actionKnown: true}, c.Now())
				},
			},
			wantLog: "no recovery action pending",
		},
		{
			name: "reboot class stays while the GPU answers throughout",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 79, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.probe("GPU-1", probeResult{reach: reachOK}, c.Now()) },
			},
			wantBad: true, wantLog: "XID 79",
		},
		{
			name: "lost GPU recovers once it answers again, XID 79 with it",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 79, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.probe("GPU-1", probeResult{reach: reachLost}, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.probe("GPU-1", probeResult{reach: reachOK}, c.Now()) },
			},
			wantLog: "after being unreachable",
		},
		{
			name: "reset-required clears when calls succeed again",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) {
					tr.probe("GPU-1", probeResult{reach: reachResetRequired}, c.Now())
				},
				func(tr *tracker, c *simtest.Clock) { tr.probe("GPU-1", probeResult{reach: reachOK}, c.Now()) },
			},
			wantLog: "GPU answers NVML again",
		},
		{
			name: "agent reset clears reset class",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 48, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.noteReset("GPU-1", c.Now()) },
			},
			wantLog: "the agent reset the GPU",
		},
		{
			name: "agent reset does not clear reboot class",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 79, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) { tr.noteReset("GPU-1", c.Now()) },
			},
			wantBad: true, wantLog: "XID 79",
		},
		{
			name: "policy change clears XIDs it now ignores",
			steps: []func(*tracker, *simtest.Clock){
				func(tr *tracker, c *simtest.Clock) { tr.xid("GPU-1", 94, gpuWide, gpuWide, c.Now()) },
				func(tr *tracker, c *simtest.Clock) {
					tr.setPolicy(PolicyFromConfig(config.Health{IgnoredXids: []int{94}}), c.Now())
				},
			},
			wantLog: "the policy now ignores it",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := newTestTracker(Policy{QuietPeriod: quiet})
			c := simtest.NewClock()
			for _, step := range tt.steps {
				step(tr, c)
			}
			s := tr.state()
			if _, bad := s.Unhealthy("GPU-1::0"); bad != tt.wantBad {
				t.Errorf("replica unhealthy = %v, want %v (causes %+v)", bad, tt.wantBad, s.Causes)
			}
			if _, bad := s.Unhealthy("GPU-0"); bad {
				t.Error("GPU-0 was marked by GPU-1's events")
			}
			last := s.Log[len(s.Log)-1]
			found := false
			for _, e := range s.Log {
				found = found || strings.Contains(e.Message, tt.wantLog)
			}
			if !found {
				t.Errorf("no log entry mentions %q: %+v", tt.wantLog, s.Log)
			}
			if !tt.wantBad && last.Action != ActionHealthy {
				t.Errorf("last log action %q, want %q", last.Action, ActionHealthy)
			}
		})
	}
}

func TestLostGPUKeptAcrossInventories(t *testing.T) {
	tr := newTestTracker(Policy{})
	now := simtest.NewClock().Now()
	tr.probe("GPU-0", probeResult{reach: reachLost}, now)
	// The next inventory lacks the lost GPU: it must stay marked, MIG devices too.
	tr.setInventory(&gpu.Inventory{GPUs: []gpu.GPU{{Index: 1, UUID: "GPU-1"}}})
	s := tr.state()
	for _, id := range []string{"GPU-0", "MIG-2-1"} {
		if _, bad := s.Unhealthy(id); !bad {
			t.Errorf("%s healthy after its GPU dropped out of the inventory", id)
		}
	}
}

func TestLogBounded(t *testing.T) {
	tr := newTestTracker(Policy{})
	now := simtest.NewClock().Now()
	for i := range 3 * maxLogEntries {
		tr.xid("GPU-1", 13, AllInstances, AllInstances, now.Add(time.Duration(i)))
	}
	s := tr.state()
	if len(s.Log) != maxLogEntries {
		t.Fatalf("log has %d entries, want %d", len(s.Log), maxLogEntries)
	}
	if !s.Log[len(s.Log)-1].Time.Equal(now.Add(time.Duration(3*maxLogEntries - 1))) {
		t.Errorf("log lost the newest entry")
	}
}
