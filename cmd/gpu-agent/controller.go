package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/gpu-agent/gpu-agent/computedomain/controller"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// electionTiming is client-go's leader election timing.
type electionTiming struct {
	lease, renew, retry time.Duration
}

// cmdController runs the ComputeDomain controller: the cluster side of
// compute domains, as a Deployment of one or more replicas of which the
// Lease's holder works.
func cmdController(ctx context.Context, args []string, _, stderr io.Writer) error {
	fs := newFlagSet("controller", "controller [flags]", stderr)
	kubeconfig := fs.String("kubeconfig", envDefault("KUBECONFIG", ""), "kubeconfig file (empty: the in-cluster service account) [KUBECONFIG]")
	namespace := fs.String("namespace", envDefault("POD_NAMESPACE", ""),
		"the controller's namespace: its Lease and the daemons' ResourceClaimTemplates [POD_NAMESPACE]")
	host, _ := os.Hostname()
	identity := fs.String("identity", envDefault("POD_NAME", host), "this replica's name in the Lease [POD_NAME]")
	leaderElect := fs.Bool("leader-elect", true, "work only while holding the Lease (false: a single replica, for tests)")
	leaseName := fs.String("lease-name", "gpu-agent-controller", "the Lease the replicas compete for")
	var timing electionTiming
	fs.DurationVar(&timing.lease, "lease-duration", 15*time.Second, "how long a replica waits for a silent leader before taking over")
	fs.DurationVar(&timing.renew, "renew-deadline", 10*time.Second, "how long the leader tries to renew before it stops working")
	fs.DurationVar(&timing.retry, "retry-period", 2*time.Second, "how often replicas try to take or renew the Lease")
	workers := fs.Int("workers", 2, "domains reconciled at once")
	resync := fs.Duration("resync", 10*time.Minute, "reconcile every domain this often even without events")
	listen := fs.String("listen", envDefault("GPU_AGENT_LISTEN", ":8080"), "address of /healthz and /readyz (empty: none) [GPU_AGENT_LISTEN]")
	logLevel := fs.String("log-level", envDefault("GPU_AGENT_LOG_LEVEL", "info"), "debug, info, warn or error [GPU_AGENT_LOG_LEVEL]")
	logFormat := fs.String("log-format", envDefault("GPU_AGENT_LOG_FORMAT", "text"), "text or json [GPU_AGENT_LOG_FORMAT]")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	switch {
	case *namespace == "":
		return usageError{"--namespace (or POD_NAMESPACE): required"}
	case *identity == "":
		return usageError{"--identity (or POD_NAME): required"}
	case *workers <= 0:
		return usageError{fmt.Sprintf("--workers %d: must be positive", *workers)}
	case *leaderElect && !(timing.lease > timing.renew && timing.renew > timing.retry && timing.retry > 0):
		return usageError{"--lease-duration, --renew-deadline, --retry-period: want lease > renew > retry > 0"}
	}
	log, err := newLogger(stderr, *logLevel, *logFormat)
	if err != nil {
		return usageError{err.Error()}
	}
	cfg, err := controllerConfig(*kubeconfig)
	if err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("kubernetes API: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("kubernetes API: %w", err)
	}
	ctl, err := controller.New(controller.Options{Dynamic: dyn, Kube: kube, Namespace: *namespace,
		Resync: *resync, Workers: *workers, Log: log})
	if err != nil {
		return err
	}
	health := leaderelection.NewLeaderHealthzAdaptor(2 * timing.renew)
	if *listen != "" {
		ln, err := net.Listen("tcp", *listen)
		if err != nil {
			return fmt.Errorf("--listen %s: %w", *listen, err)
		}
		srv := controllerHTTP(health, ctl)
		go func() { _ = srv.Serve(ln) }()
		defer srv.Close()
	}
	log.Info("gpu-agent controller starting", "namespace", *namespace, "identity", *identity, "leader-elect", *leaderElect)
	if !*leaderElect {
		return ctl.Run(ctx)
	}
	return runElected(ctx, kube, *namespace, *leaseName, *identity, timing, health, log, ctl.Run)
}

// controllerConfig is the API config: --kubeconfig, else the pod's
// service account. The controller's rate limit is above a node agent's:
// it is one per cluster, and each domain's placement costs a write per
// node.
func controllerConfig(kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes API: %w", err)
	}
	cfg.UserAgent = "gpu-agent-controller/" + version
	cfg.QPS, cfg.Burst = 20, 50
	return cfg, nil
}

func controllerHTTP(health *leaderelection.HealthzAdaptor, ctl *controller.Controller) *http.Server {
	mux := http.NewServeMux()
	// Alive unless it holds the Lease without having renewed it: a leader
	// stuck past its renew deadline is restarted.
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := health.Check(r); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	// Ready once the leader's caches synced; a standby is ready to take
	// over at any time.
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok", ctl.Synced())
	})
	return &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
}

// errLostLease ends a controller that stopped being the leader while
// running: another replica may be working already, so this one exits and
// comes back as a candidate.
var errLostLease = errors.New("lost the controller Lease")

// runElected runs work while this replica holds the Lease
// namespace/name; it returns when ctx ends (releasing the Lease) or the
// Lease is lost.
func runElected(ctx context.Context, kube kubernetes.Interface, namespace, name, identity string, timing electionTiming,
	health *leaderelection.HealthzAdaptor, log *slog.Logger, work func(context.Context) error) error {
	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// OnStartedLeading runs on a goroutine of its own that Run does not
	// wait for: what it sets is read only after it has said it is done.
	var workErr error
	var led atomic.Bool
	done := make(chan struct{})
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: &resourcelock.LeaseLock{
			LeaseMeta:  metav1.ObjectMeta{Namespace: namespace, Name: name},
			Client:     kube.CoordinationV1(),
			LockConfig: resourcelock.ResourceLockConfig{Identity: identity},
		},
		LeaseDuration:   timing.lease,
		RenewDeadline:   timing.renew,
		RetryPeriod:     timing.retry,
		ReleaseOnCancel: true,
		WatchDog:        health,
		Name:            name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				defer close(done)
				led.Store(true)
				log.Info("holding the controller Lease: working", "lease", namespace+"/"+name)
				workErr = work(ctx)
				cancel()
			},
			OnStoppedLeading: func() { log.Info("controller Lease released", "lease", namespace+"/"+name) },
			OnNewLeader: func(who string) {
				if who != identity {
					log.Info("standing by", "leader", who)
				}
			},
		},
	})
	if err != nil {
		return fmt.Errorf("leader election: %w", err)
	}
	le.Run(ctx)
	if !led.Load() {
		return nil
	}
	// Run has cancelled the context work was given: it returns.
	<-done
	switch {
	case workErr != nil:
		return workErr
	case parent.Err() == nil:
		return errLostLease
	}
	return nil
}
