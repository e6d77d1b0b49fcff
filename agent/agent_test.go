package agent

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
)

func topologyPolicy(t *testing.T, name string) topology.Policy {
	t.Helper()
	p, err := topology.ParsePolicy(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The whole loop running: Run, a real health watcher posting to the inbox,
// the built-in default config. A fatal XID marks only its GPU; a reset
// clears it.
func TestRunHealthMarksAndRecovers(t *testing.T) {
	node := simNode(t, "dgx-a100")
	inbox := NewInbox()
	log := slog.New(slog.NewTextHandler(testWriter{t}, nil))
	w := health.NewWatcher(node, health.PolicyFromConfig(config.Health{ProbeInterval: config.Duration(20 * time.Millisecond)}), health.WatcherOptions{
		WaitTimeout: 10 * time.Millisecond,
		OnChange:    func(s *health.State) { inbox.Post(HealthChanged{State: s}) },
		Logger:      log,
	})
	pub := newRecorder()
	a := New(Options{Observer: mig.NewObserver(node, gpu.Options{}), Inbox: inbox, Publisher: pub, Health: w, ResyncInterval: time.Hour, Logger: log,
		WaitForConfig: true})
	// The config's health policy is what the watcher runs with once the
	// config is in force: probe often, so the reset is seen at once.
	inbox.Post(ConfigChanged{Update: config.Update{Data: []byte("version: v1\nconfigs:\n  default:\n    health:\n      probeInterval: 20ms\n")}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{}, 2)
	go func() { w.Run(ctx); done <- struct{}{} }()
	go func() { a.Run(ctx); done <- struct{}{} }()
	defer func() { cancel(); <-done; <-done }()

	gpuOf := func(idx int) (id string, healthy bool, reason string) {
		r := pub.last().Resources[ResourceGPU]
		if r == nil {
			return "", false, ""
		}
		for _, d := range r.Devices {
			if d.GPU == idx {
				return d.ID, d.Healthy, d.Reason
			}
		}
		return "", false, ""
	}
	testwait.For(t, "first catalog", func() bool { id, _, _ := gpuOf(1); return id != "" })
	testwait.For(t, "events registered", func() bool { return len(w.Watched()) == 8 })
	node.InjectXID(0, 13) // application class: ignored by default
	node.InjectXID(1, 48)
	testwait.For(t, "GPU 1 unhealthy", func() bool { _, ok, _ := gpuOf(1); return !ok })
	// The XID's own cause, or the double-bit ECC count it left (whichever
	// the watcher saw first: its start-up scan may read the count before
	// the event arrives).
	if _, _, why := gpuOf(1); !strings.Contains(why, "48") && !strings.Contains(why, "double-bit ECC") {
		t.Errorf("reason %q names neither XID 48 nor its ECC error", why)
	}
	for i := range 8 {
		if _, ok, why := gpuOf(i); i != 1 && !ok {
			t.Errorf("GPU %d unhealthy (%s); only GPU 1 had a fatal XID", i, why)
		}
	}
	node.Reset(1)
	testwait.For(t, "GPU 1 healthy after its reset", func() bool { _, ok, _ := gpuOf(1); return ok })
}
