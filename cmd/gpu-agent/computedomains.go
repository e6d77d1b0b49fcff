package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/imex"
)

// computeDomains is the node side of compute domains (package imex): the
// second DRA driver, compute-domain.nvidia.com, its ComputeDomain watch and
// its IMEX daemons.
type computeDomains struct {
	driver  *imex.Driver
	watcher *imex.Watcher
	daemons *imex.Supervisor
}

// The IMEX programs of a real node, looked up on PATH.
const (
	imexBinary    = "nvidia-imex"
	imexCtlBinary = "nvidia-imex-ctl"
)

// newComputeDomains builds the compute-domain.nvidia.com driver when the
// node's GPUs are attached to a multi-node NVLink fabric (nil otherwise):
// --dra with the API is all it takes, no flag of its own. On simulated
// nodes the daemons are the agent's own stand-in (imex-sim).
func (w *wiring) newComputeDomains() (*computeDomains, error) {
	inv, err := gpu.New(w.be.Lib, w.be.InventoryOptions)
	if err != nil {
		return nil, fmt.Errorf("compute domains: read the GPUs: %w", err)
	}
	if !imex.FabricOf(inv).Attached {
		return nil, nil
	}
	if w.be.DriverRoot == "" {
		return nil, fmt.Errorf("compute domains: the simulated node has no driver files (sim option root=)")
	}
	sup := imex.SupervisorOptions{Dir: filepath.Join(w.f.stateDir, "imex"), Logger: w.log.With("component", "imex")}
	if w.be.Sim != nil {
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("compute domains: the IMEX stand-in: %w", err)
		}
		sup.Binary, sup.Args, sup.CtlBinary, sup.CtlArgs = self, []string{imexSimCommand}, self, []string{imexCtlSimCommand}
	} else {
		// A node without the programs gets no daemon, and the channels
		// are tainted (TaintIMEX) once starts fail: the log says why.
		sup.Binary, _ = exec.LookPath(imexBinary)
		sup.CtlBinary, _ = exec.LookPath(imexCtlBinary)
	}
	cw, err := cdi.NewWriter(w.f.cdiSpecDir)
	if err != nil {
		return nil, err
	}
	watcher := imex.NewWatcher(w.clients.Dynamic, w.log.With("component", "imex"))
	daemons := imex.NewSupervisor(sup)
	pluginDir := ""
	if w.f.draPluginDir != "" {
		// Beside gpu.nvidia.com's: the kubelet's plugins/<driver> layout.
		pluginDir = filepath.Join(filepath.Dir(w.f.draPluginDir), imex.DriverName)
	}
	d, err := imex.New(imex.Options{NodeName: w.f.nodeName, Client: w.client, ClaimReader: w.clients.Claims,
		Domains: watcher, Status: imex.Reporter{Client: w.clients.Dynamic}, Daemons: daemons, StateDir: w.f.stateDir, CDI: cw, HostRoot: w.be.DriverRoot,
		PluginDir: pluginDir, RegistryDir: w.f.kubeletRegistryDir, Logger: w.log.With("component", "imex")})
	if err != nil {
		return nil, err
	}
	d.SetInventory(inv)
	return &computeDomains{driver: d, watcher: watcher, daemons: daemons}, nil
}

// start registers the driver and runs its watch, daemons and refreshes.
func (c *computeDomains) start(ctx context.Context, goRun func(string, func() error)) error {
	goRun("compute domains watch", func() error { return c.watcher.Run(ctx) })
	goRun("imex daemons", func() error { return c.daemons.Run(ctx) })
	goRun("compute domains", func() error {
		return c.driver.Follow(ctx, 30*time.Second, c.watcher.Changes(), c.daemons.Changes())
	})
	return c.driver.Start(ctx)
}

// withComputeDomains serves the driver's state at /status/compute-domains
// (the clique, the channels' faults, each claim's channel, each domain's
// daemon and what it waits for) beside the handler's own paths.
func withComputeDomains(h http.Handler, c *computeDomains) http.Handler {
	if c == nil {
		return h
	}
	mux := http.NewServeMux()
	mux.Handle("/", h)
	mux.HandleFunc("GET /status/compute-domains", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(c.driver.Status())
	})
	return mux
}
