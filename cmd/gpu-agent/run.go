package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/imex"
	"github.com/gpu-agent/gpu-agent/kube"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/plugin"
	"github.com/gpu-agent/gpu-agent/podresources"
	"github.com/gpu-agent/gpu-agent/stateformat"
	"github.com/gpu-agent/gpu-agent/telemetry"
	"github.com/gpu-agent/gpu-agent/timeslice"
)

// runFlags are `gpu-agent run`'s flags; each has an environment variable.
type runFlags struct {
	backend, config, nodeName, pluginDir, podResources string
	kubeconfig, configMap, defaultConfig               string
	listen, stateDir, mpsRoot, nvmlLib                 string
	mpsBinary, mpsShmDir, nvidiaSMI                    string
	logLevel, logFormat                                string
	migStrategy                                        string
	draPluginDir, kubeletRegistryDir                   string
	cdiSpecDir, devRoot, migMinors                     string
	hostProc                                           string
	resync, forgetGone, sampleInterval                 time.Duration
	migCloseGrace                                      time.Duration
	mpsHost, dra                                       bool
	// mpsBinarySet: --mps-binary or its variable was given, so even a
	// simulated node runs that program rather than the stand-in.
	mpsBinarySet bool
}

func (f *runFlags) register(fsAdd func(p *string, name, env, def, help string)) {
	host, _ := os.Hostname()
	fsAdd(&f.backend, "backend", "GPU_AGENT_BACKEND", "nvml", "GPU backend: nvml, or sim:<profile> for a simulated node")
	fsAdd(&f.config, "config", "GPU_AGENT_CONFIG", "", "config file (the mounted ConfigMap key); empty: built-in default (whole GPUs)")
	fsAdd(&f.nodeName, "node-name", "NODE_NAME", host, "this node's name, for per-node config selection")
	fsAdd(&f.pluginDir, "device-plugin-dir", "GPU_AGENT_DEVICE_PLUGIN_DIR", "/var/lib/kubelet/device-plugins", "kubelet device plugin directory (holds kubelet.sock); a sim: backend without it: ./.run/device-plugins")
	fsAdd(&f.podResources, "pod-resources-socket", "GPU_AGENT_POD_RESOURCES_SOCKET", "/var/lib/kubelet/pod-resources/kubelet.sock", "kubelet pod-resources API socket; a sim: backend without it: ./.run/pod-resources.sock")
	fsAdd(&f.listen, "listen", "GPU_AGENT_LISTEN", ":9400", "HTTP address for /metrics, /healthz, /readyz, /status; a sim: backend without it: "+simListen)
	fsAdd(&f.stateDir, "state-dir", "GPU_AGENT_STATE_DIR", "/var/lib/gpu-agent", "directory for state that must survive restarts; a sim: backend without it: ./.run/state")
	fsAdd(&f.mpsRoot, "mps-root", "GPU_AGENT_MPS_ROOT", "/run/gpu-agent/mps", "root of the MPS pipe and log directories; a sim: backend without it: ./.run/mps")
	fsAdd(&f.mpsBinary, "mps-binary", "GPU_AGENT_MPS_BINARY", mps.DefaultBinary, "MPS control program, by path or found on PATH; "+mpsControlSimCommand+": gpu-agent's own stand-in (the default on a simulated node)")
	fsAdd(&f.nvidiaSMI, "nvidia-smi", "GPU_AGENT_NVIDIA_SMI", timeslice.DefaultSMI, "nvidia-smi, by path or found on PATH, to set the time slice DRA claims' TimeSlicing config asks for (empty, or a simulated node: only the Default interval is honoured) and to reset an idle GPU whose MIG mode change waits for a reset (mig.resetPolicy; empty: never)")
	fsAdd(&f.mpsShmDir, "mps-shm-dir", "GPU_AGENT_MPS_SHM_DIR", "/dev/shm", "host directory MPS daemons and their clients share as /dev/shm")
	fsAdd(&f.kubeconfig, "kubeconfig", "KUBECONFIG", "", "kubeconfig for the Kubernetes API (empty: in-cluster config when in a pod, else standalone)")
	fsAdd(&f.configMap, "configmap", "GPU_AGENT_CONFIGMAP", "", "NAMESPACE/NAME of the ConfigMap to read the config from through the API (wins over --config, which stays the fallback)")
	fsAdd(&f.defaultConfig, "default-config", "GPU_AGENT_DEFAULT_CONFIG", "", "config (a key of a multi-key ConfigMap) for nodes no entry or label selects, before \"default\" (NVIDIA's config.default)")
	// NVIDIA's variable name, so a device plugin DaemonSet's env carries over.
	fsAdd(&f.migStrategy, "mig-strategy", "MIG_STRATEGY", "", "none, single or mixed: MIG strategy of configs that set none, mig-parted entries and the implicit default (empty: none for configs, mixed for the others; the GPU Operator sets single)")
	fsAdd(&f.draPluginDir, "dra-plugin-dir", "GPU_AGENT_DRA_PLUGIN_DIR", "/var/lib/kubelet/plugins/"+devicemodel.DriverName, "where the DRA driver's socket goes (with --dra)")
	fsAdd(&f.kubeletRegistryDir, "kubelet-registry-dir", "GPU_AGENT_KUBELET_REGISTRY_DIR", "/var/lib/kubelet/plugins_registry", "the kubelet's plugin registration directory (with --dra)")
	fsAdd(&f.cdiSpecDir, "cdi-spec-dir", "GPU_AGENT_CDI_SPEC_DIR", cdi.DefaultDir, "where the node's CDI spec goes, written while the DRA driver or a CDI device list strategy needs it (empty: never)")
	// NVIDIA's variable name, as for MIG_STRATEGY.
	fsAdd(&f.devRoot, "nvidia-dev-root", "NVIDIA_DEV_ROOT", "/", "host root under which the driver's /dev/nvidia* nodes are (the driver container's root under the GPU Operator)")
	fsAdd(&f.migMinors, "mig-minors", "GPU_AGENT_MIG_MINORS", cdi.MigMinorsPath, "the driver's MIG capability table, for the CDI spec of MIG devices (sim backends number them as the driver does)")
	fsAdd(&f.hostProc, "host-proc", "GPU_AGENT_HOST_PROC", "/proc", "the host's /proc, to find the pod of each GPU process NVML reports (the chart mounts it at /host/proc; /proc is right with hostPID or outside a container; empty: processes are not attributed, and on a simulated node only those whose cgroup the sim was given are)")
	fsAdd(&f.nvmlLib, "nvml-lib", "GPU_AGENT_NVML_LIB", "", "path of libnvidia-ml.so.1 for the nvml backend (empty: the loader's search path)")
	fsAdd(&f.logLevel, "log-level", "GPU_AGENT_LOG_LEVEL", "info", "debug, info, warn or error")
	fsAdd(&f.logFormat, "log-format", "GPU_AGENT_LOG_FORMAT", "text", "text or json")
}

// runFlagSet defines `gpu-agent run`'s flags into f; README's flags table
// is checked against it.
func runFlagSet(f *runFlags, stderr io.Writer) (*flag.FlagSet, error) {
	fs := newFlagSet("run", "run [flags]", stderr)
	f.register(func(p *string, name, env, def, help string) {
		fs.StringVar(p, name, envDefault(env, def), fmt.Sprintf("%s [%s]", help, env))
	})
	resync, err := time.ParseDuration(envDefault("GPU_AGENT_RESYNC", "30s"))
	if err != nil {
		return nil, usageError{fmt.Sprintf("GPU_AGENT_RESYNC: %v", err)}
	}
	fs.DurationVar(&f.resync, "resync", resync, "re-read the GPUs this often even without events [GPU_AGENT_RESYNC]")
	forgetGone, err := time.ParseDuration(envDefault("GPU_AGENT_FORGET_GONE_GPUS_AFTER", "24h"))
	if err != nil {
		return nil, usageError{fmt.Sprintf("GPU_AGENT_FORGET_GONE_GPUS_AFTER: %v", err)}
	}
	fs.DurationVar(&f.forgetGone, "forget-gone-gpus-after", forgetGone,
		"a GPU NVML no longer enumerates (swapped out) is offered unhealthy this long, then forgotten, once nothing holds it; 0: never [GPU_AGENT_FORGET_GONE_GPUS_AFTER]")
	migCloseGrace, err := time.ParseDuration(envDefault("GPU_AGENT_MIG_CLOSE_GRACE", "1m"))
	if err != nil {
		return nil, usageError{fmt.Sprintf("GPU_AGENT_MIG_CLOSE_GRACE: %v", err)}
	}
	fs.DurationVar(&f.migCloseGrace, "mig-close-grace", migCloseGrace,
		"with migOnDemand.spareGPUs, how long a surplus spare GPU's MIG devices on demand stay published, tainted gpu.nvidia.com/closing, before they go (with spareLayout, also how long a GPU is offered whole, tainted, before its layout replaces it): longer than the scheduler takes to see the taint and bind a pod given one just before [GPU_AGENT_MIG_CLOSE_GRACE]")
	sampleInterval, err := time.ParseDuration(envDefault("GPU_AGENT_SAMPLE_INTERVAL", "10s"))
	if err != nil {
		return nil, usageError{fmt.Sprintf("GPU_AGENT_SAMPLE_INTERVAL: %v", err)}
	}
	fs.DurationVar(&f.sampleInterval, "sample-interval", sampleInterval,
		"read the GPUs' metrics and their processes' use this often: what /metrics, /holders and idle times lag by at most (at least 1s) [GPU_AGENT_SAMPLE_INTERVAL]")
	if err := registerMPSHostFlag(fs, &f.mpsHost); err != nil {
		return nil, err
	}
	if err := registerBoolFlag(fs, &f.dra, "dra", "GPU_AGENT_DRA",
		"also offer the GPUs through Dynamic Resource Allocation, as driver "+devicemodel.DriverName+" (needs the Kubernetes API)"); err != nil {
		return nil, err
	}
	return fs, nil
}

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f, simMoved, err := parseRun(args, stderr)
	if err != nil {
		return err
	}
	logger, err := newLogger(stderr, f.logLevel, f.logFormat)
	if err != nil {
		return usageError{err.Error()}
	}
	if len(simMoved) > 0 {
		logger.Info("simulated node: flags not given keep it off the host (give them to use the host's)", "set", simMoved)
	}
	return runAgent(ctx, f, logger)
}

// parseRun reads `gpu-agent run`'s flags and variables and checks them; on
// a simulated node it applies simDefaults, whose settings it returns.
func parseRun(args []string, stderr io.Writer) (runFlags, []string, error) {
	var f runFlags
	fs, err := runFlagSet(&f, stderr)
	if err != nil {
		return f, nil, err
	}
	if err := parseNoArgs(fs, args); err != nil {
		return f, nil, err
	}
	// given: set on the command line or by the flag's variable.
	given := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	f.register(func(_ *string, name, env, _, _ string) { given[name] = given[name] || envDefault(env, "") != "" })
	f.mpsBinarySet = given["mps-binary"]
	var simMoved []string
	if strings.HasPrefix(f.backend, "sim:") {
		dir, err := filepath.Abs(simRunDir)
		if err != nil {
			return f, nil, fmt.Errorf("simulated node: %s: %w", simRunDir, err)
		}
		simMoved = f.simDefaults(dir, given)
	}
	if err := (config.ParseOptions{MIGStrategy: config.MIGStrategy(f.migStrategy)}).Check(); err != nil {
		return f, nil, usageError{"--mig-strategy: " + err.Error()}
	}
	if f.sampleInterval < time.Second {
		// Each pass walks every GPU's and MIG device's NVML queries and
		// processes; faster than that costs NVML more than it tells.
		return f, nil, usageError{fmt.Sprintf("--sample-interval %s: at least 1s", f.sampleInterval)}
	}
	if f.migCloseGrace < time.Second {
		// Shorter than the scheduler takes to see a taint, the grace would
		// drop partitions it has just given to claims.
		return f, nil, usageError{fmt.Sprintf("--mig-close-grace %s: at least 1s", f.migCloseGrace)}
	}
	if f.dra && f.cdiSpecDir == "" {
		// Its answers are CDI names: without the spec the runtime fails
		// every container given one.
		return f, nil, usageError{"--dra needs --cdi-spec-dir: the DRA driver hands out CDI device names, resolved through the spec written there"}
	}
	return f, simMoved, nil
}

// simRunDir is where a simulated node keeps, unless told otherwise, what a
// real node keeps in the kubelet's and the system's directories: `make run`'s
// directory, under the working directory.
const simRunDir = ".run"

// simListen is a simulated node's --listen unless told otherwise.
const simListen = "127.0.0.1:9400"

// simDefaults keeps a simulated node off the host: each flag below that was
// not given (given: on the command line or by its variable) is set to what
// `make run` passes, loopback and dir. Their defaults are a real node's, so
// `gpu-agent run --backend sim:X` as root would otherwise create
// /var/lib/kubelet/device-plugins and /var/lib/gpu-agent, register made-up
// GPUs with a kubelet running there, and serve the unauthenticated /sim
// fault injection on every interface. The DaemonSet and the chart pass every
// one of these flags, so a simulated node in a cluster runs as before. It
// returns what it set, as --name=value.
func (f *runFlags) simDefaults(dir string, given map[string]bool) []string {
	var set []string
	for _, d := range []struct {
		name  string
		p     *string
		value string
	}{
		{"listen", &f.listen, simListen},
		{"device-plugin-dir", &f.pluginDir, filepath.Join(dir, "device-plugins")},
		{"pod-resources-socket", &f.podResources, filepath.Join(dir, "pod-resources.sock")},
		{"state-dir", &f.stateDir, filepath.Join(dir, "state")},
		{"mps-root", &f.mpsRoot, filepath.Join(dir, "mps")},
	} {
		if !given[d.name] {
			*d.p = d.value
			set = append(set, "--"+d.name+"="+d.value)
		}
	}
	return set
}

func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// runAgent is `gpu-agent run`: it wires the agent's parts in the order they
// depend on each other, runs them until ctx ends, and stops them.
func runAgent(ctx context.Context, f runFlags, log *slog.Logger) error {
	setMemoryLimit(log, os.ReadFile)
	be, err := openBackend(f.backend, f.nvmlLib, log)
	if err != nil {
		return err
	}
	defer be.Close()
	restored, err := openState(f.stateDir, log)
	if err != nil {
		return err
	}
	w := &wiring{f: f, log: log, be: be, inbox: agent.NewInbox(), reg: newRegistry()}
	w.observers(restored)
	// The MPS daemons' supervisor, or with --mps-host the agent's side of
	// mps-host, which runs them outside this container (mpshost.go).
	if w.mps, err = newMPSControl(f, be.Sim != nil, log); err != nil {
		return err
	}
	// The ledger: Allocate, DRA Prepare and the MIG applier all pass
	// through it, so no device is handed out and destroyed at once.
	held, err := ledger.New(ledger.Options{StateDir: f.stateDir, Logger: log.With("component", "ledger")})
	if newer := (*stateformat.NewerError)(nil); errors.As(err, &newer) {
		held.Close()
		return err
	}
	if err != nil {
		log.Error("allocation log", "error", err)
	}
	defer held.Close()
	if err := w.devicePlugin(held); err != nil {
		return err
	}
	if err := w.configSources(); err != nil {
		return err
	}
	w.draDriver()
	cdiSpecs, err := cdiKeeper(f, be)
	if err != nil {
		return err
	}
	ag := w.newAgent(restored, held, cdiSpecs)
	return w.serve(ctx, ag)
}

// wiring holds the agent's parts while runAgent builds them, step by step.
type wiring struct {
	f   runFlags
	log *slog.Logger
	be  *backend
	// inbox is the agent's one inbox; every producer posts to it.
	inbox *agent.Inbox
	reg   *prometheus.Registry

	watcher *health.Watcher
	sampler *telemetry.Sampler
	podres  *podresources.Client
	holders *telemetry.HolderTracker
	// gpuMetrics is the Collector's series, rendered once per pass; set
	// before any goroutine runs.
	gpuMetrics *telemetry.Exposition
	mps        mpsControl
	mgr        *plugin.Manager

	cfgWatcher *config.Watcher // nil without --config
	// The Kubernetes API's parts: all nil and empty when standalone.
	clients   *kube.Clients
	client    kubernetes.Interface
	cluster   agent.Cluster
	pub       *kube.Publisher
	pods      *kube.PodWatcher // the node's Pods, for per-process attribution
	configMap string           // read through the API, for /status
	kubeRuns  []func(context.Context) error

	dra         *dra.Driver // nil without --dra or without the API
	draPub      agent.DRAPublisher
	claimStatus agent.ClaimStatusPublisher
	// cd is the compute-domain.nvidia.com driver: with dra, on nodes
	// whose GPUs are fabric-attached (computedomains.go).
	cd *computeDomains
}

// newRegistry is the Prometheus registry of /metrics, with the process's
// own series and the build's.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		newBuildInfoMetric(buildInfo()))
	return reg
}

// openState makes the state directory and reads what must survive a
// restart: allocations not yet accounted for, health causes, the GPUs last
// seen. A bad checkpoint is set aside and the agent starts from what NVML
// shows (nil).
func openState(dir string, log *slog.Logger) (*agent.Checkpoint, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("--state-dir: %w", err)
	}
	// A bad checkpoint is set aside and the agent starts from what NVML
	// shows. One a newer agent wrote in a format this build cannot read is
	// not: starting without what it records would destroy what it protects
	// (docs/upgrade.md).
	restored, err := agent.LoadCheckpoint(dir)
	if newer := (*stateformat.NewerError)(nil); errors.As(err, &newer) {
		return nil, err
	}
	if err != nil {
		log.Error("checkpoint not restored; starting from what NVML shows", "error", err)
	}
	return restored, nil
}

// observers builds what watches the node for the loop and for metrics: the
// health watcher marks devices, the sampler caches telemetry for scrapes,
// pod-resources attributes devices to pods.
func (w *wiring) observers(restored *agent.Checkpoint) {
	var savedHealth []health.SavedCause
	if restored != nil {
		savedHealth = restored.Health
	}
	inbox, log := w.inbox, w.log
	w.watcher = health.NewWatcher(w.be.Lib, health.PolicyFromConfig(config.Health{}), health.WatcherOptions{
		Logger:   log.With("component", "health"),
		Restore:  savedHealth,
		BootID:   w.be.BootID,
		OnChange: func(s *health.State) { inbox.Post(agent.HealthChanged{State: s}) },
	})
	w.sampler = telemetry.NewSampler(w.be.Lib, telemetry.SamplerOptions{Interval: w.f.sampleInterval, Logger: log.With("component", "metrics"), OnPass: w.metricsChanged})
	w.podres = podresources.NewClient(podresources.Options{
		Socket: w.f.podResources, Logger: log.With("component", "pod-resources"),
		OnChange: func(a *podresources.Attribution) {
			inbox.Post(agent.HoldingsChanged{Attribution: a, Answered: time.Now()})
		},
	})
}

// devicePlugin builds the device plugin's servers, which check each
// Allocate against the ledger.
func (w *wiring) devicePlugin(held *ledger.Ledger) error {
	inbox, podres, useDRA := w.inbox, w.podres, w.f.dra
	mgr, err := plugin.NewManager(plugin.Options{
		Dir: w.f.pluginDir, Logger: w.log.With("component", "plugin"),
		Admit: agent.Admit(held),
		OnAllocate: func(resource string, ids []string) {
			if useDRA {
				// The device leaves the DRA pool at once; without DRA
				// the loop has nothing to do (the ledger has it).
				inbox.Post(agent.Allocated{Resource: resource, IDs: ids})
			}
			podres.Invalidate()
		},
	})
	w.mgr = mgr
	return err
}

// configSources sets up where the config comes from: the file (--config),
// and the Kubernetes API, when there is one: the Node's labels pick the
// config, the ConfigMap is read directly (faster than a mounted volume),
// and labels and Events go back. Trouble with the API never stops the
// agent: it serves standalone.
func (w *wiring) configSources() error {
	f, log, inbox := w.f, w.log, w.inbox
	if f.config != "" {
		cw, err := config.NewWatcher(f.config, log.With("component", "config"))
		if err != nil {
			return fmt.Errorf("--config %s: %w", f.config, err)
		}
		w.cfgWatcher = cw
	}
	clients, how, err := kube.Connect(f.kubeconfig, "gpu-agent")
	switch {
	case err != nil:
		log.Error("kubernetes API not usable; running standalone", "error", err)
	case clients == nil:
		log.Info("no kubeconfig and not in a pod: running standalone, without the Kubernetes API")
	default:
		log.Info("kubernetes API", "via", how, "node", f.nodeName)
		w.clients, w.client = clients, clients.Agent
		pub := kube.NewPublisher(w.client, f.nodeName, log.With("component", "kube"))
		w.cluster = pub
		var nodeUID types.UID // the watcher calls one at a time
		nodes := kube.NewNodeWatcher(w.client, f.nodeName, func(n kube.NodeInfo) {
			inbox.Post(agent.LabelsChanged{Labels: n.Labels})
			inbox.Post(agent.CordonChanged{GPUs: kube.SplitCordon(n.Cordon)})
			// The Node created again (its data restored from a backup,
			// the node registered anew): the ResourceSlices the old one
			// owned are gone or going, so compare them now, not at the
			// next periodic check. w.dra is set before the watch runs.
			if nodeUID != "" && n.UID != nodeUID && w.dra != nil {
				w.dra.CheckSoon()
			}
			nodeUID = n.UID
		}, log.With("component", "kube"))
		w.pub = pub
		// The node's Pods name the pod UIDs and container IDs the cgroups
		// of GPU processes give (telemetry.HolderTracker).
		w.pods = kube.NewPodWatcher(w.client, f.nodeName, log.With("component", "kube"))
		// A device-plugin pod's end shows in pod-resources, which is
		// listed again then rather than at its next MaxAge: its holder's
		// series go within a pass of the pod leaving.
		w.pods.OnPodEnded(w.podres.Invalidate)
		w.kubeRuns = append(w.kubeRuns, pub.Run, nodes.Run, w.pods.Run)
		pub.Track(nodes, w.pods)
		if f.configMap != "" {
			ns, name, err := kube.ParseConfigMapRef(f.configMap)
			if err != nil {
				return usageError{"--configmap " + err.Error()}
			}
			cms := kube.NewConfigMapWatcher(w.client, ns, name, func(data map[string]string, deleted bool) {
				inbox.Post(agent.ConfigChanged{Update: configMapUpdate(data, deleted), Source: agent.SourceAPI})
			}, log.With("component", "kube"))
			w.kubeRuns = append(w.kubeRuns, cms.Run)
			pub.Track(cms)
			w.configMap = ns + "/" + name
		}
	}
	if f.configMap != "" && w.client == nil {
		log.Warn("--configmap needs the Kubernetes API; using --config only", "configmap", f.configMap)
	}
	if w.client == nil {
		// No Node watch will answer: a cordon restored from the checkpoint
		// could never be lifted, so none stands without the API.
		inbox.Post(agent.CordonChanged{})
	}
	return nil
}

// draDriver builds the DRA driver (--dra, with the API): it publishes what
// the loop plans and asks the loop to prepare claims; it starts once the
// loop exists (serve).
func (w *wiring) draDriver() {
	f, log := w.f, w.log
	switch {
	case f.dra && w.client == nil:
		log.Error("--dra needs the Kubernetes API (ResourceSlices); DRA is off, the device plugin serves alone")
	case f.dra:
		w.dra = dra.New(dra.Options{NodeName: f.nodeName, Client: w.client, ClaimReader: w.clients.Claims, PluginDir: f.draPluginDir,
			RegistryDir: f.kubeletRegistryDir, Logger: log.With("component", "dra")})
		w.draPub = w.dra
		// What a device model costs the scheduler depends on its version
		// (a /status warning names a config that is slow on it).
		versions := kube.NewVersionWatcher(w.client.Discovery(), func(v string) {
			w.inbox.Post(agent.ControlPlaneChanged{Version: v})
		}, log.With("component", "kube"))
		w.kubeRuns = append(w.kubeRuns, versions.Run)
		// Each prepared claim's devices, written into its status in the
		// background (kubectl describe resourceclaim shows them).
		sw := dra.NewClaimStatusWriter(dra.ClaimStatusOptions{Client: w.client, NodeName: f.nodeName, Logger: log.With("component", "dra")})
		w.claimStatus = sw
		w.kubeRuns = append(w.kubeRuns, sw.Run)
		cd, err := w.newComputeDomains()
		if err != nil {
			log.Error("compute-domain.nvidia.com not served", "error", err)
		}
		w.cd = cd
	}
}

// cdiKeeper is the node's CDI spec writer (--cdi-spec-dir; nil without).
func cdiKeeper(f runFlags, be *backend) (agent.CDISpecs, error) {
	if f.cdiSpecDir == "" {
		return nil, nil
	}
	cw, err := cdi.NewWriter(f.cdiSpecDir)
	if err != nil {
		return nil, usageError{"--cdi-spec-dir: " + err.Error()}
	}
	k := &cdi.Keeper{W: cw, DevRoot: f.devRoot, Exists: func(p string) bool { _, err := os.Stat(p); return err == nil }}
	if be.Sim == nil {
		k.Caps = func() (cdi.CapMinors, error) { return cdi.ReadMigMinors(f.migMinors) }
	}
	return k, nil
}

// newAgent builds the loop over every part, and registers the metrics
// collector that reads it.
func (w *wiring) newAgent(restored *agent.Checkpoint, held *ledger.Ledger, cdiSpecs agent.CDISpecs) *agent.Agent {
	f, be := w.f, w.be
	var slicer agent.TimeSlicer
	if be.Sim == nil && f.nvidiaSMI != "" {
		slicer = timeslice.Interval{Binary: f.nvidiaSMI}
	}
	// A MIG mode change that waits for a reset is applied by resetting the
	// GPU (mig.resetPolicy): through nvidia-smi on a real node, as NVIDIA's
	// mig-manager does, and through the sim's own reset on a simulated one.
	var resetter agent.GPUResetter
	switch {
	case be.Sim != nil:
		node := be.Sim
		resetter = mig.NewResetter(be.Lib, func(_ context.Context, g gpu.GPU) error { return node.Reset(g.Index) })
	case f.nvidiaSMI != "":
		resetter = mig.NewResetter(be.Lib, mig.SMIReset(f.nvidiaSMI))
	}
	// The tracker reads the agent's DRA claims and the agent feeds it
	// inventories and the config: it is made once the agent is, before
	// either runs.
	var holders *telemetry.HolderTracker
	var idleAfter atomic.Int64

	ag := agent.New(agent.Options{
		Observer:           mig.NewObserver(be.Lib, be.InventoryOptions),
		NodeName:           f.nodeName,
		ConfigSource:       f.config,
		ConfigMap:          w.configMap,
		WaitForConfig:      w.cfgWatcher != nil || (w.client != nil && f.configMap != ""),
		DefaultConfig:      f.defaultConfig,
		MIGStrategy:        config.MIGStrategy(f.migStrategy),
		Cluster:            w.cluster,
		DRA:                w.draPub,
		ClaimStatus:        w.claimStatus,
		CDI:                cdiSpecs,
		Inbox:              w.inbox,
		Publisher:          w.mgr,
		Health:             w.watcher,
		Holdings:           w.podres,
		MIG:                mig.NewApplier(be.Lib, f.stateDir, w.log.With("component", "mig")),
		Reset:              resetter,
		ForeignPlugins:     func() map[string]string { return plugin.ForeignSockets(f.pluginDir) },
		MPS:                w.mps,
		MPSRoot:            f.mpsRoot,
		MPSShmDir:          f.mpsShmDir,
		TimeSlice:          slicer,
		InventoryObservers: append(w.inventoryObservers(), func(inv *gpu.Inventory) { holders.SetInventory(inv) }),
		ConfigObservers:    []func(*config.Config){idleAfterFrom(&idleAfter)},
		StateDir:           f.stateDir,
		Restored:           restored,
		BootID:             be.BootID(),
		Ledger:             held,
		ResyncInterval:     f.resync,
		MIGCloseGrace:      f.migCloseGrace,
		ForgetGoneAfter:    f.forgetGone,
		Logger:             w.log.With("component", "agent"),
		Registerer:         w.reg,
	})
	holders = w.holderTracker(ag, &idleAfter)
	w.holders = holders
	// The GPU series are rendered once per pass, off the scrape path, and
	// served beside the registry's (telemetry.Exposition).
	w.gpuMetrics = telemetry.NewExposition(telemetry.NewCollector(telemetry.CollectorOptions{
		Samples: w.sampler, Health: w.watcher, Attribution: w.podres, Catalog: ag, DRA: ag, Hostname: f.nodeName,
		Holders: holders,
	}))
	return ag
}

// metricsChanged tells the GPU series' rendering that a pass published new
// figures (the sampler's, the holder tracker's).
func (w *wiring) metricsChanged() {
	if w.gpuMetrics != nil {
		w.gpuMetrics.Kick()
	}
}

// inventoryObservers are told each inventory the loop reads.
func (w *wiring) inventoryObservers() []func(*gpu.Inventory) {
	obs := []func(*gpu.Inventory){w.sampler.SetInventory}
	if w.cd != nil {
		obs = append(obs, w.cd.driver.SetInventory)
	}
	return obs
}

// serve starts the HTTP server and every goroutine, then the DRA driver;
// it returns once ctx ends (or one of them failed) and all have stopped.
func (w *wiring) serve(ctx context.Context, ag *agent.Agent) error {
	f, log, inbox := w.f, w.log, w.inbox
	var draSlices func() dra.Slices
	if w.dra != nil {
		draSlices = w.dra.Slices
	}
	handler := withComputeDomains(withHolders(newHTTPHandler(ag, w.mgr, w.watcher, w.sampler, draSlices, w.reg, w.gpuMetrics, w.be), w.holders), w.cd)
	srv, ln, err := newHTTPServer(f.listen, handler, defaultHTTPServerConfig(), log.With("component", "http"))
	if err != nil {
		return fmt.Errorf("--listen %s: %w", f.listen, err)
	}
	b := buildInfo()
	log.Info("gpu-agent starting", "version", b.Version, "commit", b.Commit, "backend", w.be.Name, "node", f.nodeName, "listen", ln.Addr().String(),
		"device-plugin-dir", f.pluginDir, "config", f.config)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g := &group{cancel: cancel}
	goRun := g.Go
	goRun("plugin manager", func() error { return w.mgr.Run(ctx) })
	goRun("agent", func() error { return ag.Run(ctx) })
	goRun("health watcher", func() error { return w.watcher.Run(ctx) })
	goRun("metrics sampler", func() error { return w.sampler.Run(ctx) })
	goRun("holders", func() error { return w.holders.Run(ctx) })
	goRun("GPU metrics rendering", func() error { return w.gpuMetrics.Run(ctx) })
	goRun("pod-resources", func() error { return w.podres.Run(ctx) })
	goRun("mps supervisor", func() error { return w.mps.Run(ctx) })
	goRun("mps events", func() error {
		return forward(ctx, w.mps.Changes(), inbox, func(struct{}) agent.Event { return agent.MPSChanged{} })
	})
	if w.cfgWatcher != nil {
		updates := make(chan config.Update)
		goRun("config watcher", func() error { return w.cfgWatcher.Run(ctx, updates) })
		goRun("config events", func() error {
			return forward(ctx, updates, inbox, func(u config.Update) agent.Event { return agent.ConfigChanged{Update: u} })
		})
	}
	// Probes and scrapes are answered whatever the DRA driver and the API
	// server do.
	goRun("http", func() error {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	if w.dra != nil {
		w.dra.SetClaims(claimsThenList{ag, w.podres})
		// A driver that cannot register leaves the device plugin serving:
		// the node loses DRA, not its GPUs.
		if err := w.dra.Start(ctx); err != nil {
			log.Error("DRA driver not started; the device plugin serves alone", "error", err)
		} else {
			defer w.dra.Stop()
			log.Info("DRA driver registered", "driver", devicemodel.DriverName, "plugin-dir", f.draPluginDir)
		}
	}
	if w.cd != nil {
		if err := w.cd.start(ctx, goRun); err != nil {
			log.Error("compute-domain.nvidia.com not started", "error", err)
		} else {
			defer w.cd.driver.Stop()
			log.Info("DRA driver registered", "driver", imex.DriverName)
		}
	}
	for i, run := range w.kubeRuns {
		goRun(fmt.Sprintf("kubernetes API %d", i), func() error { return run(ctx) })
	}

	<-ctx.Done()
	log.Info("gpu-agent stopping: removing plugin sockets")
	shutdownCtx, done := context.WithTimeout(context.Background(), 5*time.Second)
	defer done()
	_ = srv.Shutdown(shutdownCtx)
	if err := g.Wait(); err != nil {
		return err
	}
	log.Info("gpu-agent stopped")
	return nil
}

// group runs the agent's goroutines: the first that fails stops them all
// (cancel), and Wait returns every error once all have returned. Errors are
// kept in a slice, not a channel, so no number of failing goroutines can
// block one on its way out.
type group struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	errs   []error
}

// Go runs fn in a goroutine of the group; name prefixes its error.
func (g *group) Go(name string, fn func() error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		if err := fn(); err != nil {
			g.mu.Lock()
			g.errs = append(g.errs, fmt.Errorf("%s: %w", name, err))
			g.mu.Unlock()
			g.cancel()
		}
	}()
}

// Wait waits for every goroutine and joins their errors.
func (g *group) Wait() error {
	g.wg.Wait()
	g.mu.Lock()
	defer g.mu.Unlock()
	return errors.Join(g.errs...)
}

// forward posts each value from ch to the inbox as the event ev makes of it.
func forward[T any](ctx context.Context, ch <-chan T, inbox *agent.Inbox, ev func(T) agent.Event) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case v := <-ch:
			inbox.Post(ev(v))
		}
	}
}

// configMapUpdate turns a ConfigMap's data into config content: every key,
// as a mounted ConfigMap directory gives them; deleted, no content (the
// mounted file takes over).
func configMapUpdate(data map[string]string, deleted bool) config.Update {
	if deleted {
		return config.Update{}
	}
	if data == nil {
		data = map[string]string{}
	}
	return config.Update{Files: data}
}

// claimsThenList asks pod-resources again after each Prepare and Unprepare:
// the kubelet lists a claim's devices once it is prepared and stops once
// it is not, and metrics should follow without waiting for the next
// periodic List. The kubelet records the outcome only once the answer
// reaches it, after these calls return, so it asks once more a little
// later (pod-resources' rate limit merges the two when they come close).
type claimsThenList struct {
	dra.Claims
	podres interface{ Invalidate() }
}

// PrepareClaims implements [dra.Claims].
func (c claimsThenList) PrepareClaims(ctx context.Context, claims []dra.Claim) (map[types.UID]dra.Prepared, error) {
	defer c.listSoon()
	return c.Claims.PrepareClaims(ctx, claims)
}

// UnprepareClaims implements [dra.Claims].
func (c claimsThenList) UnprepareClaims(ctx context.Context, claims []dra.ClaimRef) (map[types.UID]error, error) {
	defer c.listSoon()
	return c.Claims.UnprepareClaims(ctx, claims)
}

func (c claimsThenList) listSoon() {
	c.podres.Invalidate()
	time.AfterFunc(3*time.Second, c.podres.Invalidate)
}
