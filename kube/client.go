// Package kube is gpu-agent's side of the Kubernetes API: it watches the
// agent's own Node (labels pick the config) and the ConfigMap it is given (an
// input like the mounted file), and writes back what the node offers: the
// labels it owns (GPU feature discovery's names), nvidia.com/mig.config.state
// and rate-limited Node Events. Without an API the agent runs standalone.
package kube

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/homedir"
)

// Standalone is what /status says when there is no API to talk to.
const Standalone = "standalone: no API"

// Clients are the agent's ways to the API server, each rate-limited for
// its own work.
type Clients struct {
	// Agent serves the agent's own watches and writes: its Node and
	// ConfigMap, labels, Events and ResourceSlices. A node agent's few
	// requests must not pile up behind a busy API server, nor become a
	// burst when it comes back: QPS 5, burst 10.
	Agent kubernetes.Interface
	// Claims reads the ResourceClaims the kubelet asks the DRA driver to
	// prepare, one GET per claim while the kubelet waits (ClaimQPS,
	// ClaimBurst).
	Claims kubernetes.Interface
	// Dynamic reads custom resources (ComputeDomains, for the node side
	// of compute domains), at the agent's own rate limit.
	Dynamic dynamic.Interface
}

// The claim reads' rate limit. Their number is the kubelet's work, not the
// agent's: as many as the claims of the pods starting, all at once when a
// node starts its pods after a reboot. At the agent's own 5 a second, one
// Prepare of 100 claims took 18 s and one of 1000 ran into its deadline
// (issue 24). A burst of 1000 takes 1000 claims at once; the API server's
// priority and fairness, not this limit, protects it from many nodes.
const (
	ClaimQPS   = 100
	ClaimBurst = 1000
)

// Connect returns the clients from kubeconfig (a path; "" = the KUBECONFIG
// variable's, then in-cluster config). With neither a kubeconfig nor the
// in-cluster environment it returns (nil, "", nil): the agent runs
// standalone. how says where the config came from, for the log.
func Connect(kubeconfig, userAgent string) (clients *Clients, how string, err error) {
	var cfg *rest.Config
	switch {
	case kubeconfig != "":
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		how = "kubeconfig " + kubeconfig
	case os.Getenv("KUBERNETES_SERVICE_HOST") != "":
		cfg, err = rest.InClusterConfig()
		how = "in-cluster service account"
	default:
		return nil, "", nil
	}
	if err != nil {
		return nil, how, fmt.Errorf("kubernetes API (%s): %w", how, err)
	}
	clients, err = newClients(cfg, userAgent)
	if err != nil {
		return nil, how, fmt.Errorf("kubernetes API (%s): %w", how, err)
	}
	return clients, how, nil
}

// ConnectAsKubectl returns clients found as kubectl finds its config: the
// path given, else the KUBECONFIG variable's files, else ~/.kube/config,
// else the in-cluster service account. For the commands a person runs
// (gpu-agent cordon), not for the agent, which must never pick up a
// user's file by accident.
func ConnectAsKubectl(kubeconfig, userAgent string) (*Clients, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	if os.Getenv(clientcmd.RecommendedConfigPathEnvVar) == "" {
		// The home directory now, not when the package was initialised.
		rules.Precedence = []string{filepath.Join(homedir.HomeDir(), clientcmd.RecommendedHomeDir, clientcmd.RecommendedFileName)}
	}
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{})
	cfg, err := cc.ClientConfig()
	how := "kubeconfig " + strings.Join(rules.GetLoadingPrecedence(), ":")
	if kubeconfig != "" {
		how = "kubeconfig " + kubeconfig
	}
	if err != nil {
		return nil, how, fmt.Errorf("kubernetes API (%s): %w", how, err)
	}
	clients, err := newClients(cfg, userAgent)
	if err != nil {
		return nil, how, fmt.Errorf("kubernetes API (%s): %w", how, err)
	}
	return clients, how, nil
}

// newClients builds the agent's and the claim reader's clients from cfg,
// each with its rate limit.
func newClients(cfg *rest.Config, userAgent string) (*Clients, error) {
	cfg.UserAgent = userAgent
	agent, claims := rest.CopyConfig(cfg), rest.CopyConfig(cfg)
	agent.QPS, agent.Burst = 5, 10
	claims.QPS, claims.Burst = ClaimQPS, ClaimBurst
	clients := &Clients{}
	var err error
	if clients.Agent, err = kubernetes.NewForConfig(agent); err != nil {
		return nil, err
	}
	if clients.Claims, err = kubernetes.NewForConfig(claims); err != nil {
		return nil, err
	}
	if clients.Dynamic, err = dynamic.NewForConfig(agent); err != nil {
		return nil, err
	}
	return clients, nil
}

// ParseConfigMapRef reads --configmap's NAMESPACE/NAME.
func ParseConfigMapRef(ref string) (namespace, name string, err error) {
	namespace, name, ok := strings.Cut(ref, "/")
	if !ok || namespace == "" || name == "" || strings.Contains(name, "/") {
		return "", "", fmt.Errorf("%q: want NAMESPACE/NAME", ref)
	}
	return namespace, name, nil
}
