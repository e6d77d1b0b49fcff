package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/telemetry"
	procusage "github.com/gpu-agent/gpu-agent/usage"
)

// holdersAgent is what the holder tracker reads from the agent: the
// devices of DRA claims and the catalog's MPS limits.
type holdersAgent interface {
	telemetry.DRASource
	telemetry.CatalogSource
}

// holderTracker builds the per-holder usage tracker: processes from NVML
// (real or simulated), their pods from the host's /proc (--host-proc) or,
// for a simulated node's made-up PIDs, from the cgroup the sim keeps for
// them, named by the node's Pods through the API. Without the API (or
// without --host-proc on a real node) holders still get their idle time
// where no process runs and the device's own figures where they hold it
// alone, but processes are not attributed.
func (w *wiring) holderTracker(ag holdersAgent, idleAfter *atomic.Int64) *telemetry.HolderTracker {
	f, be := w.f, w.be
	var owners telemetry.OwnerResolver
	var host *procusage.Resolver
	if f.hostProc != "" {
		host = procusage.NewResolver(f.hostProc)
		owners = host
	}
	if be.Sim != nil {
		owners = procusage.SimResolver{Src: be.Sim, Next: host}
	}
	opts := telemetry.HolderOptions{
		Interval:    f.sampleInterval,
		Owners:      owners,
		Attribution: w.podres,
		DRA:         ag,
		Catalog:     ag,
		Samples:     w.sampler,
		StatePath:   filepath.Join(f.stateDir, telemetry.HolderStateFile),
		Logger:      w.log.With("component", "holders"),
		IdleAfter:   func() time.Duration { return time.Duration(idleAfter.Load()) },
		OnPass:      w.metricsChanged,
	}
	if w.pods != nil {
		opts.Pods = w.pods
	}
	if w.pub != nil && w.pods != nil {
		pub, pods := w.pub, w.pods
		opts.OnIdle = func(u telemetry.HolderUse) {
			if ref, ok := pods.Ref(u.Namespace, u.Pod); ok {
				pub.ObjectEvent(&ref, false, "GPUAllocationIdle", idleMessage(u))
			}
		}
	}
	return telemetry.NewHolderTracker(be.Lib, opts)
}

// idleAfterFrom keeps the config's usage.idleEventAfter for the tracker.
func idleAfterFrom(v *atomic.Int64) func(*config.Config) {
	return func(c *config.Config) {
		var d time.Duration
		if c != nil {
			d = c.Usage.IdleEventAfter.D()
		}
		v.Store(int64(d))
	}
}

// idleMessage is the GPUAllocationIdle Event's text: who, which device,
// for how long, and the figures that say so.
func idleMessage(u telemetry.HolderUse) string {
	var b strings.Builder
	fmt.Fprintf(&b, "container %s", u.Container)
	if u.Claim != nil {
		fmt.Fprintf(&b, " (claim %s/%s)", u.Claim.Namespace, u.Claim.Name)
	}
	fmt.Fprintf(&b, " has not used GPU %d (%s", u.GPU, u.GPUUUID)
	if u.MIGProfile != "" {
		fmt.Fprintf(&b, ", MIG %s %s", u.MIGProfile, u.Device)
	}
	fmt.Fprintf(&b, ") for %s", (time.Duration(u.IdleSeconds) * time.Second).String())
	if u.Sharers > 1 {
		fmt.Fprintf(&b, ", one of %d holders of the device", u.Sharers)
	}
	fmt.Fprintf(&b, "; SM now %.0f%%", u.SM)
	for _, w := range []string{"1h", "24h"} {
		if v, ok := u.SMAvg[w]; ok {
			fmt.Fprintf(&b, ", mean over %s %.1f%%", w, v)
		}
	}
	if u.Attributed {
		fmt.Fprintf(&b, "; %d processes hold %s of its memory", u.Processes, bytesIEC(u.FBBytes))
	}
	b.WriteString(". Nothing is done about it: release the GPU if it is not needed.")
	return b.String()
}

// bytesIEC writes n in the largest binary unit that keeps it at 1 or more.
func bytesIEC(n uint64) string {
	const units = "KMGTPE"
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n)/1024, 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return fmt.Sprintf("%.1f %ciB", v, units[i])
}

// holdersHandler serves GET /holders: the tracker's last pass, as JSON.
func holdersHandler(src telemetry.HolderSource) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		snap := src.Holders()
		if snap.Holders == nil {
			snap = &telemetry.HolderSnapshot{Time: snap.Time, Holders: []telemetry.HolderUse{}}
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(snap)
	})
}

// withHolders adds GET /holders to h.
func withHolders(h http.Handler, src telemetry.HolderSource) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /holders", holdersHandler(src))
	mux.Handle("/", h)
	return mux
}
