package main

import (
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// The faults of README's Quick start, and the way back from each, on an
// agent with a simulated node that keeps its state: XID 48 clears with a GPU
// reset, XID 79 only with a reboot, live or while the agent was down; and
// starting over with new GPU state does not bring an old cause back from
// the agent's checkpoint.
func TestSimFaultsAndRecovery(t *testing.T) {
	dir, err := os.MkdirTemp("", "ga")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pluginDir := filepath.Join(dir, "dp")
	if err := os.Mkdir(pluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	startFakeKubelet(t, pluginDir)
	simState := filepath.Join(dir, "sim-state.json")
	// Probed every 200 ms rather than 10 s: the reset and the reboot are
	// seen by probes.
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("version: v1\nconfigs:\n  default:\n    health:\n      probeInterval: 200ms\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	start := func() *command {
		return startCommand(t, "run", "--backend", "sim:pcie-4gpu,state="+simState, "--config", cfg, "--device-plugin-dir", pluginDir,
			"--listen", addr, "--state-dir", filepath.Join(dir, "state"), "--node-name", "n1",
			"--mps-root", filepath.Join(dir, "mps"), "--pod-resources-socket", filepath.Join(dir, "podres.sock"))
	}
	post := func(path, body string) {
		t.Helper()
		resp, err := http.Post("http://"+addr+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("POST %s %s: %s", path, body, resp.Status)
		}
	}
	// unhealthy is the reasons GPU i is unhealthy for, "" when healthy.
	unhealthy := func(st *agent.Status, i int) string {
		for _, r := range st.Resource {
			for _, d := range r.Devices {
				if d.GPU == i && !d.Healthy {
					return d.Reason
				}
			}
		}
		return ""
	}
	healthy := func(i int) func(*agent.Status) bool {
		return func(st *agent.Status) bool { return len(st.Resource) > 0 && unhealthy(st, i) == "" }
	}
	sick := func(i int, reason string) func(*agent.Status) bool {
		return func(st *agent.Status) bool { return strings.Contains(unhealthy(st, i), reason) }
	}

	ag := start()
	waitStatus(t, addr, "serving GPU 1 healthy", healthy(1))
	post("/sim/xid", `{"gpu":0,"xid":79}`)
	post("/sim/xid", `{"gpu":1,"xid":48}`)
	waitStatus(t, addr, "GPU 0 unhealthy after XID 79, GPU 1 after XID 48", func(st *agent.Status) bool {
		return sick(0, "XID 79")(st) && sick(1, "XID 48")(st)
	})
	post("/sim/reset", `{"gpu":0}`)
	post("/sim/reset", `{"gpu":1}`)
	// One probe of every GPU finds GPU 1 reset: by then GPU 0's reset was
	// seen too, and does not do for XID 79.
	st := waitStatus(t, addr, "GPU 1 healthy after its reset", healthy(1))
	if unhealthy(st, 0) == "" {
		t.Fatal("a GPU reset cleared XID 79, which needs a reboot")
	}
	post("/sim/reboot", ``)
	waitStatus(t, addr, "GPU 0 healthy after the reboot", healthy(0))

	// XID 79 again; the agent stops and its checkpoint keeps the cause. A
	// plain restart restores it.
	post("/sim/xid", `{"gpu":2,"xid":79}`)
	waitStatus(t, addr, "GPU 2 unhealthy after XID 79", sick(2, "XID 79"))
	if code := ag.stop(t); code != 0 {
		t.Fatalf("agent exited %d", code)
	}
	ag = start()
	waitStatus(t, addr, "GPU 2 still unhealthy after an agent restart", sick(2, "XID 79"))
	if code := ag.stop(t); code != 0 {
		t.Fatalf("agent exited %d", code)
	}
	// The node reboots while no agent runs: the next agent does not
	// restore the cause.
	node, err := sim.New("pcie-4gpu", sim.WithStateFile(simState), sim.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Reboot(); err != nil {
		t.Fatal(err)
	}
	node.Close()
	ag = start()
	st = waitStatus(t, addr, "GPU 2 healthy after a reboot while the agent was down", healthy(2))
	if len(st.HealthCauses) != 0 {
		t.Errorf("health causes after the reboot: %+v", st.HealthCauses)
	}

	// Starting over with new GPU state (its file deleted) is a new boot
	// too: the checkpoint's cause does not come back.
	post("/sim/xid", `{"gpu":3,"xid":79}`)
	waitStatus(t, addr, "GPU 3 unhealthy after XID 79", sick(3, "XID 79"))
	if code := ag.stop(t); code != 0 {
		t.Fatalf("agent exited %d", code)
	}
	if err := os.Remove(simState); err != nil {
		t.Fatal(err)
	}
	start()
	waitStatus(t, addr, "GPU 3 healthy on new GPU state", healthy(3))
}
