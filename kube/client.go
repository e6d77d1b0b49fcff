// Package kube is gpu-agent's side of the Kubernetes API: it watches the
// agent's own Node (labels pick the config) and the ConfigMap it is given (an
// input like the mounted file), and writes back what the node offers: the
// labels it owns (GPU feature discovery's names), nvidia.com/mig.config.state
// and rate-limited Node Events. Without an API the agent runs standalone.
package kube

import (
	"fmt"
	"os"
	"strings"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Standalone is what /status says when there is no API to talk to.
const Standalone = "standalone: no API"

// Connect returns a client from kubeconfig (a path; "" = the KUBECONFIG
// variable's, then in-cluster config). With neither a kubeconfig nor the
// in-cluster environment it returns (nil, "", nil): the agent runs
// standalone. how says where the config came from, for the log.
func Connect(kubeconfig, userAgent string) (client kubernetes.Interface, how string, err error) {
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
	cfg.UserAgent = userAgent
	// A node agent's few requests must not pile up behind a busy API
	// server, nor become a burst when it comes back.
	cfg.QPS, cfg.Burst = 5, 10
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, how, fmt.Errorf("kubernetes API (%s): %w", how, err)
	}
	return c, how, nil
}

// ParseConfigMapRef reads --configmap's NAMESPACE/NAME.
func ParseConfigMapRef(ref string) (namespace, name string, err error) {
	namespace, name, ok := strings.Cut(ref, "/")
	if !ok || namespace == "" || name == "" || strings.Contains(name, "/") {
		return "", "", fmt.Errorf("%q: want NAMESPACE/NAME", ref)
	}
	return namespace, name, nil
}
