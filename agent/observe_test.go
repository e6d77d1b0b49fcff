package agent

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// layoutOn0 is a config that gives GPU 0 alone the MIG devices counts.
func layoutOn0(counts string) string {
	return "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: [0]\n        mig-enabled: true\n        mig-devices: " + counts + "\n"
}

// migOffered lists the MIG devices the last catalog offers on GPU gpu,
// healthy or not.
func migOffered(h *harness, gpu int) []string {
	var out []string
	for name, r := range h.pub.last().Resources {
		for _, d := range r.Devices {
			if strings.HasPrefix(name, "nvidia.com/mig-") && d.GPU == gpu {
				out = append(out, d.ID)
			}
		}
	}
	slices.Sort(out)
	return out
}

// A GPU a MIG plan ran on, and that cannot be read whole since, stays
// offered as failed with no MIG device across an agent restart (issue 29,
// defect 6): the restarted agent must not fall back on the checkpoint's
// record of it, which does not say what NVML has now (written before the
// plan, it has the devices the plan destroyed). Whether the agent stopped
// after the pass (the GPU already withdrawn) or was killed in the middle of
// the plan, the first catalog after the restart offers no MIG device of
// GPU 0 and /status lists it unread; once it reads whole, what it has is
// offered. The restarted agent's config governs no layout, so that what is
// offered is the record believed, not what a plan made of it.
func TestTouchedGPUStaysWithdrawnAcrossRestart(t *testing.T) {
	for _, tt := range []struct {
		name string
		// crashAfter: NVML changes after which the first agent is killed
		// (MIG mode on, a GPU and a compute instance per 1g.10gb, then the
		// repartition's destroys); 0: it is not.
		crashAfter int
	}{
		{name: "stopped after the pass"},
		{name: "killed in the middle of the plan", crashAfter: 1 + 2*7 + 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			state := filepath.Join(dir, "gpus.json")
			opts := []sim.Option{sim.WithImmediateMIGModeChange(), sim.WithStateFile(state), sim.WithLogger(quietLogger())}
			if tt.crashAfter > 0 {
				opts = append(opts, sim.WithCrashAfter(tt.crashAfter, func() { panic(crash{}) }))
			}
			node, err := sim.New("dgx-h100", opts...)
			if err != nil {
				t.Fatal(err)
			}
			node.Init()
			h := newHarnessIn(t, node, dir, withMIG())
			h.config(layoutOn0(`{"1g.10gb": 7}`))
			if n := len(migOffered(h, 0)); n != 7 {
				t.Fatalf("%d MIG devices on GPU 0, want 7", n)
			}
			if err := node.FailCalls(0, "GetMigDeviceHandleByIndex", nvml.ERROR_UNKNOWN, -1); err != nil {
				t.Fatal(err)
			}
			crashed := false
			func() {
				defer func() {
					if r := recover(); r != nil {
						if r != (crash{}) {
							panic(r)
						}
						crashed = true
					}
				}()
				h.config(layoutOn0(`{"3g.40gb": 2}`))
			}()
			if crashed != (tt.crashAfter > 0) {
				t.Fatalf("crashed %v, want %v", crashed, tt.crashAfter > 0)
			}
			h.a.Ledger().Close()
			node.Close()

			// The same GPUs, GPU 0 still not read whole, under a new agent.
			node2, err := sim.New("dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithStateFile(state), sim.WithLogger(quietLogger()))
			if err != nil {
				t.Fatal(err)
			}
			node2.Init()
			t.Cleanup(func() { node2.Close() })
			if err := node2.FailCalls(0, "GetMigDeviceHandleByIndex", nvml.ERROR_UNKNOWN, -1); err != nil {
				t.Fatal(err)
			}
			h2 := newHarnessIn(t, node2, dir, withMIG(), withCheckpoint())
			h2.config(mixedNoMIG)
			if got := migOffered(h2, 0); len(got) > 0 {
				t.Errorf("the first catalog after the restart offers %d MIG devices of GPU 0, not read whole since its plan ran: %v", len(got), got)
			}
			unread := slices.ContainsFunc(h2.a.Status().Unread, func(u UnreadGPU) bool {
				return u.Index == 0 && strings.Contains(u.Reason, "MIG devices changed")
			})
			if !unread {
				t.Errorf("after the restart GPU 0 is not listed unread since its MIG devices changed: %+v", h2.a.Status().Unread)
			}

			if err := node2.FailCalls(0, "GetMigDeviceHandleByIndex", nvml.ERROR_UNKNOWN, 0); err != nil {
				t.Fatal(err)
			}
			h2.step(Tick{})
			if got, want := len(migOffered(h2, 0)), len(gpuOf(t, h2, 0).Instances); got != want || want == 0 {
				t.Errorf("GPU 0 read whole again: %d MIG devices offered, want its %d", got, want)
			}
			if u := h2.a.Status().Unread; len(u) != 0 {
				t.Errorf("GPU 0 read whole again, still unread: %+v", u)
			}
		})
	}
}
