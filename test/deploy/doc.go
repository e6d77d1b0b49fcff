// Package deploy tests gpu-agent's install artefacts (Dockerfile, kustomize
// base, Helm chart, example ConfigMaps, dashboard) the way users consume them.
// It is its own module so the Helm and Kubernetes API dependencies stay out of
// the agent's go.mod.
package deploy
